"""``ember bench compare A B``: two result directories side by side (tables and plots).

Groups are matched by label (``c=4 max_tokens=32`` with ``c=4 max_tokens=32``);
when the two runs share no label at all (say ``single`` against ``load``)
they are matched by position instead. Changes are B relative to A.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from ember.bench.metrics import Summary  # noqa: E402
from ember.bench.report import MISSING, cdf_line, fmt_ms, fmt_number, fmt_percent, is_missing, markdown_table, save_figure  # noqa: E402
from ember.bench.result import BenchResult, Group, load_result  # noqa: E402

COMPARE_MARKDOWN = "compare.md"

# (name, value of a summary, formatter): the rows of each group's table.
METRICS: list[tuple[str, Callable[[Summary], float | None], Callable[[float | None], str]]] = [
    ("req/s", lambda s: s.request_throughput, lambda v: fmt_number(v, 2)),
    ("output tok/s", lambda s: s.output_throughput, lambda v: fmt_number(v, 1)),
    ("goodput req/s", lambda s: s.goodput, lambda v: fmt_number(v, 2)),
    ("TTFT p50 (ms)", lambda s: s.ttft.p50, fmt_ms),
    ("TTFT p99 (ms)", lambda s: s.ttft.p99, fmt_ms),
    ("TPOT mean (ms)", lambda s: s.tpot.mean, fmt_ms),
    ("ITL p99 (ms)", lambda s: s.itl.p99, fmt_ms),
    ("E2E mean (ms)", lambda s: s.e2e.mean, fmt_ms),
    ("E2E p99 (ms)", lambda s: s.e2e.p99, fmt_ms),
    ("failed requests", lambda s: float(s.failed), lambda v: fmt_number(v, 0)),
]


def matched_groups(a: BenchResult, b: BenchResult) -> list[tuple[str, Group | None, Group | None]]:
    """(label, group of A, group of B) pairs in A's order, then B's unmatched groups."""
    by_label_b = {g.label: g for g in b.groups}
    if not any(g.label in by_label_b for g in a.groups):
        pairs = []
        for i in range(max(len(a.groups), len(b.groups))):
            ga = a.groups[i] if i < len(a.groups) else None
            gb = b.groups[i] if i < len(b.groups) else None
            label = " / ".join(dict.fromkeys(g.label for g in (ga, gb) if g is not None))
            pairs.append((label, ga, gb))
        return pairs
    pairs = [(g.label, g, by_label_b.get(g.label)) for g in a.groups]
    seen = {g.label for g in a.groups}
    return pairs + [(g.label, None, g) for g in b.groups if g.label not in seen]


def change(a: float | None, b: float | None) -> float | None:
    """(b − a) / a, or None when either is missing or a is 0."""
    if is_missing(a) or is_missing(b) or a == 0:
        return None
    return (b - a) / a  # type: ignore[operator]


def compare_markdown(a: BenchResult, b: BenchResult, name_a: str, name_b: str) -> str:
    """The side-by-side tables, one per matched group."""
    parts = [f"# ember bench compare: A = {name_a}, B = {name_b}", ""]
    parts += [f"- A: {a.workload} at `{a.config.get('url')}` ({a.started_at})", f"- B: {b.workload} at `{b.config.get('url')}` ({b.started_at})"]
    differing = sorted(k for k in set(a.config) | set(b.config) if a.config.get(k) != b.config.get(k))
    if differing:
        parts.append("- configuration differences: " + ", ".join(f"{k}: `{a.config.get(k)}` → `{b.config.get(k)}`" for k in differing))
    for label, ga, gb in matched_groups(a, b):
        rows = []
        for name, value, fmt in METRICS:
            va = value(ga.summary) if ga else None
            vb = value(gb.summary) if gb else None
            rows.append([name, fmt(va) if ga else MISSING, fmt(vb) if gb else MISSING, fmt_percent(change(va, vb), signed=True)])
        parts += ["", f"## {label}", "", markdown_table(["metric", "A", "B", "B vs A"], rows)]
    parts += ["", "## Plots", "", "![compare_latency_cdf](compare_latency_cdf.png)", "", "![compare_metrics](compare_metrics.png)", ""]
    return "\n".join(parts)


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
    panels = [("requests/s", lambda s: s.request_throughput, 1.0), ("TTFT p50 (ms)", lambda s: s.ttft.p50, 1000.0),
              ("mean E2E (ms)", lambda s: s.e2e.mean, 1000.0)]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2))
    x = np.arange(len(pairs))
    for ax, (title, value, scale) in zip(axes, panels):
        for offset, side, name in ((-0.2, 1, names[0]), (0.2, 2, names[1])):
            heights = []
            for pair in pairs:
                group = pair[side]
                v = value(group.summary) if group is not None else None
                heights.append(0.0 if is_missing(v) else v * scale)  # type: ignore[operator]
            ax.bar(x + offset, heights, width=0.4, label=f"{'A' if side == 1 else 'B'}: {name}")
        ax.set_xticks(x, [p[0] for p in pairs], rotation=30, ha="right", fontsize="small")
        ax.set(title=title)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize="small")
    save_figure(fig, path)


def write_comparison(path_a: Path, path_b: Path, out_dir: Path) -> list[Path]:
    """Load two result directories and write ``compare.md`` and two PNGs into ``out_dir``."""
    a, b = load_result(path_a), load_result(path_b)
    names = (_name(path_a), _name(path_b))
    out_dir.mkdir(parents=True, exist_ok=True)
    cdf, bars, markdown = out_dir / "compare_latency_cdf.png", out_dir / "compare_metrics.png", out_dir / COMPARE_MARKDOWN
    plot_compare_cdf(a, b, names, cdf)
    plot_compare_metrics(a, b, names, bars)
    markdown.write_text(compare_markdown(a, b, *names))
    return [markdown, cdf, bars]


def _name(path: Path) -> str:
    directory = path.parent if path.is_file() else path
    return directory.resolve().name
