"""Write a result as ``summary.md``, and its PNG plots where asked for (``plots.py``).

Which plots a result gets is its ``plots`` list; each name maps to a function
in ``plots.PLOTS`` that draws ``<name>.png``. matplotlib is the optional
``plots`` extra, so this module does not import it: ``plots`` is imported only
when plots are drawn. Formatting helpers used by the workloads' own report
sections live here too, so every table looks the same.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from ember.bench.result import MARKDOWN_FILE, BenchResult, Group

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
    if fraction is None or is_missing(fraction):
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
        rows.append(
            [
                g.label,
                f"{s.completed}/{s.requests}",
                fmt_number(s.duration_s, 2),
                fmt_number(s.request_throughput, 2),
                fmt_number(s.output_throughput, 1),
                fmt_number(s.total_token_throughput, 1),
                goodput,
            ]
        )
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
        rows = [
            [
                g.label,
                str(g.summary.new_connections),
                fmt_ms(g.summary.connect.mean),
                fmt_ms(g.summary.connect.p99),
                fmt_ms(g.summary.tls.mean),
                fmt_ms(g.summary.tls.p99),
            ]
            for g in opened
        ]
        parts += [
            "",
            "## Connection set-up",
            "",
            markdown_table(["group", "new connections", "TCP mean (ms)", "TCP p99 (ms)", "TLS mean (ms)", "TLS p99 (ms)"], rows),
            "",
            (
                "Requests that opened a connection paid a TCP connect (and a TLS handshake on https) before "
                "their first byte. With pooled keep-alive connections only the pool's first requests do; with "
                "--new-connection-per-request every request does, and the difference in TTFT is the handshake cost."
            ),
        ]
    for section in result.sections:
        parts += ["", f"## {section.title}", "", section.markdown]
    if plot_files:
        parts += ["", "## Plots", ""] + [f"![{Path(name).stem}]({name})" for name in plot_files]
    if not brief:
        parts += ["", "## Definitions", "", DEFINITIONS, ""]
    return "\n".join(parts)


def write_report(result: BenchResult, out_dir: Path, *, plots: bool = True) -> list[Path]:
    """Write ``summary.md`` into ``out_dir``, and the result's plots with ``plots``; returns the files written.

    ``plots`` needs matplotlib (the ``plots`` extra): decide with ``plotting.resolve_plots``.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    if plots and result.plots:
        from ember.bench.plots import draw_plots  # matplotlib: only when drawing

        written = draw_plots(result, out_dir)
    markdown = out_dir / MARKDOWN_FILE
    markdown.write_text(render_markdown(result, [p.name for p in written]))
    return [markdown, *written]
