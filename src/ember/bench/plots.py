"""Every PNG ``ember bench`` draws: a result's plots (``PLOTS``) and ``compare``'s two.

matplotlib (headless ``Agg`` backend) is the optional ``plots`` extra; only
this module imports it, and only ``report.write_report`` and
``compare.write_comparison`` import this module, when they are asked to draw.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display: plots are files
import matplotlib.pyplot as plt
import numpy as np

from ember.bench.compare import matched_groups
from ember.bench.metrics import Stats, stats_by
from ember.bench.report import is_missing
from ember.bench.result import BenchResult, Group


def cdf_line(ax: plt.Axes, values: Sequence[float], label: str, **style: object) -> None:
    if not values:
        return
    xs = np.sort(np.asarray(values, dtype=float)) * 1000.0
    ys = np.arange(1, len(xs) + 1) / len(xs)
    # Start the staircase at 0 so the first step is visible.
    xs, ys = np.concatenate([xs[:1], xs]), np.concatenate([[0.0], ys])
    ax.step(xs, ys, where="post", label=label, **style)  # type: ignore[arg-type]


def plot_latency_cdf(result: BenchResult, path: Path) -> None:
    """TTFT and E2E cumulative distributions, one line per group."""
    fig, (ttft_ax, e2e_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    for g in result.groups:
        done = [r for r in g.records if r.ok]
        cdf_line(ttft_ax, [r.ttft_s for r in done if r.ttft_s is not None], g.label)
        cdf_line(e2e_ax, [r.e2e_s for r in done if r.e2e_s is not None], g.label)
    for ax, name in ((ttft_ax, "TTFT"), (e2e_ax, "E2E latency")):
        ax.set(title=f"{name} CDF", xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    _legend(e2e_ax)
    save_figure(fig, path)


def _series(
    groups: Sequence[Group], x_key: str, line_key: str, y: Callable[[Group], float | None]
) -> dict[object, list[tuple[float, float]]]:
    """Points (x, y) per line value, from groups whose params hold both keys."""
    lines: dict[object, list[tuple[float, float]]] = {}
    for g in groups:
        if x_key in g.params and line_key in g.params:
            value = y(g)
            if not is_missing(value):
                lines.setdefault(g.params[line_key], []).append((float(g.params[x_key]), float(value)))  # type: ignore[arg-type]
    return {key: sorted(points) for key, points in lines.items()}


def _two_panels(
    result: BenchResult, path: Path, x_key: str, line_key: str, panels: tuple[tuple[Callable[[Group], float | None], str], ...]
) -> None:
    """Side by side, one panel per (y, name): y against ``x_key``, one line per ``line_key`` value."""
    fig, axes = plt.subplots(1, len(panels), figsize=(11, 4.2))
    for ax, (y, name) in zip(axes, panels, strict=True):
        for line, points in _series(result.groups, x_key, line_key, y).items():
            ax.plot(*zip(*points, strict=True), marker="o", label=f"{line_key} {line}")
        ax.set_xticks(sorted({g.params[x_key] for g in result.groups if x_key in g.params}))
        ax.set(title=f"{name} vs {x_key}", xlabel=x_key, ylabel=name)
        ax.grid(alpha=0.3)
        _legend(ax)
    save_figure(fig, path)


def plot_throughput_vs_concurrency(result: BenchResult, path: Path) -> None:
    """Output tokens/s and requests/s against concurrency, one line per max_tokens."""
    _two_panels(
        result,
        path,
        "concurrency",
        "max_tokens",
        (
            (lambda g: g.summary.output_throughput, "output tokens/s"),
            (lambda g: g.summary.request_throughput, "requests/s"),
        ),
    )


def plot_latency_vs_max_tokens(result: BenchResult, path: Path) -> None:
    """Mean E2E latency and TTFT p50 against max_tokens, one line per concurrency."""
    _two_panels(
        result,
        path,
        "max_tokens",
        "concurrency",
        (
            (lambda g: _ms(g.summary.e2e.mean), "mean E2E latency (ms)"),
            (lambda g: _ms(g.summary.ttft.p50), "TTFT p50 (ms)"),
        ),
    )


def plot_qps_latency_vs_max_tokens(result: BenchResult, path: Path) -> None:
    """The max-tokens experiment: QPS (left axis) and mean latency (right axis) against max_tokens."""
    points = sorted((g.params["max_tokens"], g.summary.request_throughput, _ms(g.summary.e2e.mean)) for g in result.groups)
    xs = [p[0] for p in points]
    fig, qps_ax = plt.subplots(figsize=(7, 4.2))
    qps_ax.plot(xs, [p[1] for p in points], marker="o", color="tab:blue", label="QPS")
    qps_ax.set(xlabel="max_tokens", ylabel="QPS (requests/s)", title="QPS and mean latency vs max_tokens")
    latency_ax = qps_ax.twinx()
    latency_ax.plot(xs, [p[2] for p in points], marker="s", color="tab:red", label="mean latency")
    latency_ax.set(ylabel="mean latency (ms)")
    qps_ax.set_xticks(xs)
    qps_ax.grid(alpha=0.3)
    (qps_handles, qps_labels), (latency_handles, latency_labels) = (
        qps_ax.get_legend_handles_labels(),
        latency_ax.get_legend_handles_labels(),
    )
    qps_ax.legend(qps_handles + latency_handles, qps_labels + latency_labels, loc="center left", fontsize="small")
    save_figure(fig, path)


def plot_ttft_by_turn(result: BenchResult, path: Path) -> None:
    """TTFT p50 and p99 per conversation turn."""
    by_turn: dict[int, Stats] = stats_by(result.records, lambda r: r.turn, lambda r: r.ttft_s)
    turns = [t for t in by_turn if t is not None]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(turns, [_ms(by_turn[t].p50) for t in turns], marker="o", label="p50")
    ax.plot(turns, [_ms(by_turn[t].p99) for t in turns], marker="s", label="p99")
    ax.set(title="TTFT by turn", xlabel="turn", ylabel="TTFT (ms)")
    ax.set_xticks(turns)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    _legend(ax)
    save_figure(fig, path)


def plot_perceived_latency(result: BenchResult, path: Path) -> None:
    """Bars: first visible text when streaming, the whole streamed reply, the whole non-streamed reply."""
    extras = result.extras
    names = ["streaming:\nfirst text", "streaming:\nwhole reply", "non-streaming:\nwhole reply"]
    values = [_ms(extras.get(k)) for k in ("first_text_s", "stream_total_s", "full_total_s")]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.bar(names, [0.0 if is_missing(v) else v for v in values], color=["tab:green", "tab:blue", "tab:gray"])
    ax.set(title="Perceived latency (mean)", ylabel="ms")
    ax.grid(alpha=0.3, axis="y")
    save_figure(fig, path)


def _ms(seconds: float | None) -> float:
    return math.nan if is_missing(seconds) else seconds * 1000.0  # type: ignore[operator]


def _legend(ax: plt.Axes) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")


def save_figure(fig: plt.Figure, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


PlotFn = Callable[[BenchResult, Path], None]

PLOTS: dict[str, PlotFn] = {
    "latency_cdf": plot_latency_cdf,
    "throughput_vs_concurrency": plot_throughput_vs_concurrency,
    "latency_vs_max_tokens": plot_latency_vs_max_tokens,
    "qps_latency_vs_max_tokens": plot_qps_latency_vs_max_tokens,
    "ttft_by_turn": plot_ttft_by_turn,
    "perceived_latency": plot_perceived_latency,
}


def draw_plots(result: BenchResult, out_dir: Path) -> list[Path]:
    """Draw each of the result's ``plots`` as ``<name>.png`` in ``out_dir``; returns the files."""
    written = []
    for name in result.plots:
        path = out_dir / f"{name}.png"
        PLOTS[name](result, path)
        written.append(path)
    return written


# ---------------------------------------------------------------------------
# ember bench compare
# ---------------------------------------------------------------------------


def plot_compare_cdf(a: BenchResult, b: BenchResult, names: tuple[str, str], path: Path) -> None:
    """TTFT and E2E CDFs of all successful requests of A (solid) and B (dashed)."""
    fig, (ttft_ax, e2e_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    for result, name, style in ((a, names[0], "-"), (b, names[1], "--")):
        done = [r for r in result.records if r.ok]
        cdf_line(ttft_ax, [r.ttft_s for r in done if r.ttft_s is not None], f"A: {name}" if result is a else f"B: {name}", linestyle=style)
        cdf_line(e2e_ax, [r.e2e_s for r in done if r.e2e_s is not None], f"A: {name}" if result is a else f"B: {name}", linestyle=style)
    for ax, title in ((ttft_ax, "TTFT CDF"), (e2e_ax, "E2E latency CDF")):
        ax.set(title=title, xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    save_figure(fig, path)


def plot_compare_metrics(a: BenchResult, b: BenchResult, names: tuple[str, str], path: Path) -> None:
    """Bars per matched group: requests/s, TTFT p50 and mean E2E latency, A beside B."""
    pairs = matched_groups(a, b)
    panels = [
        ("requests/s", lambda s: s.request_throughput, 1.0),
        ("TTFT p50 (ms)", lambda s: s.ttft.p50, 1000.0),
        ("mean E2E (ms)", lambda s: s.e2e.mean, 1000.0),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2))
    x = np.arange(len(pairs))
    for ax, (title, value, scale) in zip(axes, panels, strict=True):
        for offset, side, name in ((-0.2, 1, names[0]), (0.2, 2, names[1])):
            heights = []
            for _, group_a, group_b in pairs:
                group = group_a if side == 1 else group_b
                v = value(group.summary) if group is not None else None
                heights.append(0.0 if is_missing(v) else v * scale)  # type: ignore[operator]
            ax.bar(x + offset, heights, width=0.4, label=f"{'A' if side == 1 else 'B'}: {name}")
        ax.set_xticks(x, [p[0] for p in pairs], rotation=30, ha="right", fontsize="small")
        ax.set(title=title)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize="small")
    save_figure(fig, path)
