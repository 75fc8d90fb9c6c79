"""``ember bench compare A B``: two result directories side by side (tables, and plots with matplotlib).

Groups are matched by label (``c=4 max_tokens=32`` with ``c=4 max_tokens=32``);
when the two runs share no label at all (say ``single`` against ``load``)
they are matched by position instead. Changes are B relative to A.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from ember.bench.metrics import Summary
from ember.bench.report import MISSING, fmt_ms, fmt_number, fmt_percent, is_missing, markdown_table
from ember.bench.result import BenchResult, Group, load_result

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


def compare_markdown(a: BenchResult, b: BenchResult, name_a: str, name_b: str, plot_files: Sequence[str] = ()) -> str:
    """The side-by-side tables, one per matched group, then the plots named in ``plot_files``."""
    parts = [f"# ember bench compare: A = {name_a}, B = {name_b}", ""]
    parts += [
        f"- A: {a.workload} at `{a.config.get('url')}` ({a.started_at})",
        f"- B: {b.workload} at `{b.config.get('url')}` ({b.started_at})",
    ]
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
    if plot_files:
        parts += ["", "## Plots"]
        for name in plot_files:
            parts += ["", f"![{Path(name).stem}]({name})"]
    return "\n".join([*parts, ""])


def write_comparison(path_a: Path, path_b: Path, out_dir: Path, *, plots: bool = True) -> list[Path]:
    """Load two result directories and write ``compare.md``, and two PNGs with ``plots`` (matplotlib), into ``out_dir``."""
    a, b = load_result(path_a), load_result(path_b)
    names = (_name(path_a), _name(path_b))
    out_dir.mkdir(parents=True, exist_ok=True)
    pngs: list[Path] = []
    if plots:
        from ember.bench.plots import plot_compare_cdf, plot_compare_metrics  # matplotlib: only when drawing

        pngs = [out_dir / "compare_latency_cdf.png", out_dir / "compare_metrics.png"]
        plot_compare_cdf(a, b, names, pngs[0])
        plot_compare_metrics(a, b, names, pngs[1])
    markdown = out_dir / COMPARE_MARKDOWN
    markdown.write_text(compare_markdown(a, b, *names, plot_files=[p.name for p in pngs]))
    return [markdown, *pngs]


def _name(path: Path) -> str:
    directory = path.parent if path.is_file() else path
    return directory.resolve().name
