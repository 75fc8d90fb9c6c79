"""Write a result as ``summary.md`` and PNG plots (matplotlib, headless ``Agg`` backend).

Which plots a result gets is its ``plots`` list; each name maps to a function
in ``PLOTS`` that draws ``<name>.png``. Formatting helpers used by the
workloads' own report sections live here too, so every table looks the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display: plots are files
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from ember.bench.metrics import Stats, stats_by  # noqa: E402
from ember.bench.result import MARKDOWN_FILE, BenchResult, Group  # noqa: E402

MISSING = "–"

DEFINITIONS = """\
- **TTFT**: time from sending a request to the first chunk with visible text (a non-streamed reply: the whole body).
- **TPOT**: per request, (E2E − TTFT) / (output tokens − 1); requests with fewer than 2 output tokens have none.
- **ITL**: every gap between consecutive text chunks, pooled over all requests.
- **E2E**: time from sending a request to the end of its reply.
- **req/s, tokens/s**: completed requests (their prompt and output tokens) divided by the group's wall time.
- **goodput**: completed requests meeting every SLO, per second.
- Latency statistics are over successful requests; percentiles interpolate linearly (vLLM's definitions)."""


def is_missing(value: float | None) -> bool:
    """True for None and NaN (a metric that could not be measured)."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def fmt_ms(seconds: float | None) -> str:
    """Seconds as milliseconds with one decimal, or a dash."""
    return MISSING if is_missing(seconds) else f"{seconds * 1000:.1f}"  # type: ignore[operator]


def fmt_number(value: float | None, digits: int = 2) -> str:
    return MISSING if is_missing(value) else f"{value:.{digits}f}"


def fmt_percent(fraction: float | None, *, signed: bool = False) -> str:
    """0.123 → "12.3 %" (or "+12.3 %" with ``signed``)."""
    if is_missing(fraction):
        return MISSING
    return f"{fraction * 100:{'+' if signed else ''}.1f} %"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def throughput_table(groups: Sequence[Group]) -> str:
    rows = []
    for g in groups:
        s = g.summary
        goodput = MISSING if s.goodput is None else f"{s.goodput:.2f} ({s.good_requests}/{s.completed})"
        rows.append([
            g.label, f"{s.completed}/{s.requests}", fmt_number(s.duration_s, 2), fmt_number(s.request_throughput, 2),
            fmt_number(s.output_throughput, 1), fmt_number(s.total_token_throughput, 1), goodput,
        ])
    return markdown_table(["group", "ok/total", "duration (s)", "req/s", "output tok/s", "total tok/s", "goodput req/s"], rows)


def latency_table(groups: Sequence[Group]) -> str:
    rows = []
    for g in groups:
        s = g.summary
        for name, stats in (("TTFT", s.ttft), ("TPOT", s.tpot), ("ITL", s.itl), ("E2E", s.e2e)):
            rows.append([g.label, name, str(stats.count), fmt_ms(stats.mean), fmt_ms(stats.p50), fmt_ms(stats.p90), fmt_ms(stats.p99)])
    return markdown_table(["group", "metric", "n", "mean (ms)", "p50 (ms)", "p90 (ms)", "p99 (ms)"], rows)


def render_markdown(result: BenchResult, plot_files: Sequence[str] = (), *, brief: bool = False) -> str:
    """The whole ``summary.md`` of ``result``; ``brief`` leaves out the configuration and definitions."""
    parts = [f"# ember bench {result.workload}", ""]
    if not brief:
        parts += [f"- started: {result.started_at}"]
        parts += [f"- {key}: `{value}`" for key, value in result.config.items()]
        parts += [f"- SLO: {result.slo}", ""]
    parts += ["## Throughput", "", throughput_table(result.groups), "", "## Latency", "", latency_table(result.groups)]
    errors = [[g.label, kind, str(count)] for g in result.groups for kind, count in g.summary.errors_by_kind.items()]
    if errors:
        parts += ["", "## Errors", "", markdown_table(["group", "kind", "requests"], errors)]
    reasons = [[g.label, ", ".join(f"{k}: {v}" for k, v in g.summary.finish_reasons.items()) or MISSING] for g in result.groups]
    parts += ["", "## How replies ended", "", markdown_table(["group", "finish reasons"], reasons)]
    opened = [g for g in result.groups if g.summary.new_connections]
    if opened:
        rows = [[g.label, str(g.summary.new_connections), fmt_ms(g.summary.connect.mean), fmt_ms(g.summary.connect.p99),
                 fmt_ms(g.summary.tls.mean), fmt_ms(g.summary.tls.p99)] for g in opened]
        parts += ["", "## Connection set-up", "",
                  markdown_table(["group", "new connections", "TCP mean (ms)", "TCP p99 (ms)", "TLS mean (ms)", "TLS p99 (ms)"], rows),
                  "", "Requests that opened a connection paid a TCP connect (and a TLS handshake on https) before "
                  "their first byte. With pooled keep-alive connections only the pool's first requests do; with "
                  "--new-connection-per-request every request does, and the difference in TTFT is the handshake cost."]
    for section in result.sections:
        parts += ["", f"## {section.title}", "", section.markdown]
    if plot_files:
        parts += ["", "## Plots", ""] + [f"![{Path(name).stem}]({name})" for name in plot_files]
    if not brief:
        parts += ["", "## Definitions", "", DEFINITIONS, ""]
    return "\n".join(parts)


# ---------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------


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


def _series(groups: Sequence[Group], x_key: str, line_key: str, y: Callable[[Group], float | None]) -> dict[object, list[tuple[float, float]]]:
    """Points (x, y) per line value, from groups whose params hold both keys."""
    lines: dict[object, list[tuple[float, float]]] = {}
    for g in groups:
        if x_key in g.params and line_key in g.params:
            value = y(g)
            if not is_missing(value):
                lines.setdefault(g.params[line_key], []).append((float(g.params[x_key]), float(value)))  # type: ignore[arg-type]
    return {key: sorted(points) for key, points in lines.items()}


def _two_panels(result: BenchResult, path: Path, x_key: str, line_key: str,
                panels: tuple[tuple[Callable[[Group], float | None], str], ...]) -> None:
    """Side by side, one panel per (y, name): y against ``x_key``, one line per ``line_key`` value."""
    fig, axes = plt.subplots(1, len(panels), figsize=(11, 4.2))
    for ax, (y, name) in zip(axes, panels):
        for line, points in _series(result.groups, x_key, line_key, y).items():
            ax.plot(*zip(*points), marker="o", label=f"{line_key} {line}")
        ax.set_xticks(sorted({g.params[x_key] for g in result.groups if x_key in g.params}))
        ax.set(title=f"{name} vs {x_key}", xlabel=x_key, ylabel=name)
        ax.grid(alpha=0.3)
        _legend(ax)
    save_figure(fig, path)


def plot_throughput_vs_concurrency(result: BenchResult, path: Path) -> None:
    """Output tokens/s and requests/s against concurrency, one line per max_tokens."""
    _two_panels(result, path, "concurrency", "max_tokens", (
        (lambda g: g.summary.output_throughput, "output tokens/s"),
        (lambda g: g.summary.request_throughput, "requests/s"),
    ))


def plot_latency_vs_max_tokens(result: BenchResult, path: Path) -> None:
    """Mean E2E latency and TTFT p50 against max_tokens, one line per concurrency."""
    _two_panels(result, path, "max_tokens", "concurrency", (
        (lambda g: _ms(g.summary.e2e.mean), "mean E2E latency (ms)"),
        (lambda g: _ms(g.summary.ttft.p50), "TTFT p50 (ms)"),
    ))


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
    handles = qps_ax.get_legend_handles_labels()[0] + latency_ax.get_legend_handles_labels()[0]
    qps_ax.legend(handles, [h.get_label() for h in handles], loc="center left", fontsize="small")
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


def write_report(result: BenchResult, out_dir: Path) -> list[Path]:
    """Draw the result's plots and write ``summary.md`` into ``out_dir``; returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name in result.plots:
        path = out_dir / f"{name}.png"
        PLOTS[name](result, path)
        written.append(path)
    markdown = out_dir / MARKDOWN_FILE
    markdown.write_text(render_markdown(result, [p.name for p in written]))
    return [markdown, *written]
