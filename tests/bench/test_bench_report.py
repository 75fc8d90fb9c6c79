"""Reports from a recorded trace: Markdown content, valid PNGs, JSON round trip, compare; plots as an extra."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ember.bench.compare import write_comparison
from ember.bench.loadgen import RunResult
from ember.bench.metrics import parse_slo
from ember.bench.record import load_records
from ember.bench.plots import PLOTS
from ember.bench.plotting import resolve_plots, skipped_plots_note
from ember.bench.report import fmt_percent, write_report
from ember.bench.result import BenchResult, Section, load_result, make_group, save_result
from ember.bench.sender import BenchError
from ember.cli import main
from server_process import free_port

pytestmark = pytest.mark.timeout(60)

TRACE = Path(__file__).parent / "data" / "bench_trace.json"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def trace_result(shift_s: float = 0.0) -> BenchResult:
    """Two groups from the trace (as two sweep points); ``shift_s`` delays every text chunk and end."""
    records = load_records(TRACE)
    for r in records:
        r.chunk_times_s = [t + shift_s for t in r.chunk_times_s]
        r.end_s = r.end_s + shift_s if r.end_s is not None else None
    first, second = records[:3], records[3:]
    slo = parse_slo("ttft=0.5,e2e=1.15")
    groups = [
        make_group("c=1 max_tokens=8", {"concurrency": 1, "max_tokens": 8}, RunResult(first, 0.0, 2.0 + shift_s), slo),
        make_group("c=2 max_tokens=8", {"concurrency": 2, "max_tokens": 8}, RunResult(second, 1.5, 4.0 + shift_s), slo),
    ]
    extras = {"first_text_s": 0.5, "stream_total_s": 1.1, "full_total_s": 1.2}
    return BenchResult("sweep", {"url": "http://x/v1", "model": "m"}, groups, slo, plots=list(PLOTS),
                       sections=[Section("A section", "hello *world*")], extras=extras)


def test_report_writes_markdown_and_valid_pngs(tmp_path):
    result = trace_result()
    written = write_report(result, tmp_path)
    pngs = [p for p in written if p.suffix == ".png"]
    assert {p.stem for p in pngs} == set(PLOTS)
    for png in pngs:
        data = png.read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000, png.name
    markdown = (tmp_path / "summary.md").read_text()
    # Group 1 holds requests 0, 1, 2 (all ok): TTFT 0.5, 0.2, 1.0 → mean 566.7 ms; 3 requests in 2.0 s.
    assert "| c=1 max_tokens=8 | 3/3 | 2.00 | 1.50 |" in markdown
    assert "| c=1 max_tokens=8 | TTFT | 3 | 566.7 | 500.0 |" in markdown
    # Group 2 holds 3 (429), 4 (timeout) and 5 (ok): 1 of 3 in 2.5 s; #5 meets both SLOs.
    assert "| c=2 max_tokens=8 | 1/3 | 2.50 | 0.40 |" in markdown
    assert "0.40 (1/1)" in markdown
    assert "| c=2 max_tokens=8 | http_429 | 1 |" in markdown and "| c=2 max_tokens=8 | timeout | 1 |" in markdown
    assert "## A section" in markdown and "hello *world*" in markdown
    assert "## Connection set-up" in markdown and "![latency_cdf](latency_cdf.png)" in markdown
    assert "ttft ≤ 0.5 s, e2e ≤ 1.15 s" in markdown


def test_result_json_round_trip(tmp_path):
    result = trace_result()
    save_result(result, tmp_path)
    raw = json.loads((tmp_path / "requests.json").read_text())
    assert len(raw) == 6 and raw[0]["group"] == "c=1 max_tokens=8" and raw[0]["ttft_s"] == pytest.approx(0.5)
    loaded = load_result(tmp_path)
    assert [g.label for g in loaded.groups] == [g.label for g in result.groups]
    assert loaded.groups[0].summary == result.groups[0].summary
    assert loaded.groups[1].records == result.groups[1].records
    assert loaded.slo == result.slo and loaded.extras == result.extras and loaded.plots == result.plots


def test_compare_two_result_directories(tmp_path, capsys, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    save_result(trace_result(), a)
    save_result(trace_result(shift_s=0.5), b)  # every reply 0.5 s later
    written = write_comparison(a, b, tmp_path / "cmp")
    assert [p.name for p in written] == ["compare.md", "compare_latency_cdf.png", "compare_metrics.png"]
    assert all(p.read_bytes()[:8] == PNG_MAGIC for p in written[1:])
    markdown = written[0].read_text()
    assert "## c=1 max_tokens=8" in markdown and "## c=2 max_tokens=8" in markdown
    # Group 1: E2E mean 1.1 s → 1.6 s (+45.5 %); req/s 3 / 2.0 s → 3 / 2.5 s (−20 %).
    assert "| E2E mean (ms) | 1100.0 | 1600.0 | +45.5 % |" in markdown
    assert "| req/s | 1.50 | 1.20 | -20.0 % |" in markdown

    # The CLI spells: `ember bench compare A B` and `ember bench --compare A B`.
    assert main(["bench", "compare", str(a), str(b), "--out", str(tmp_path / "cli")]) == 0
    assert "| E2E mean (ms) | 1100.0 | 1600.0 | +45.5 % |" in capsys.readouterr().out
    assert (tmp_path / "cli" / "compare.md").exists()
    assert main(["bench", "compare", str(a), str(tmp_path / "missing"), "--out", str(tmp_path / "x")]) == 2
    monkeypatch.chdir(tmp_path)  # --compare writes to the default bench-results/compare-<timestamp>
    assert main(["bench", "--compare", str(a), str(b)]) == 0
    assert len(list((tmp_path / "bench-results").glob("compare-*/compare.md"))) == 1


def test_fmt_percent():
    assert fmt_percent(0.1234) == "12.3 %"
    assert fmt_percent(-0.5, signed=True) == "-50.0 %"
    assert fmt_percent(None) == "–"


# ---------------------------------------------------------------------------
# matplotlib is the `plots` extra
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(("asked", "installed", "draws", "note"), [
    (None, True, True, False),   # neither flag: plots when matplotlib is there
    (None, False, False, True),  # ... and a note, not an error, when it is not
    (True, True, True, False),
    (False, True, False, False),
    (False, False, False, False),
])
def test_resolve_plots(asked, installed, draws, note):
    assert resolve_plots(asked, installed) is draws
    assert (skipped_plots_note(asked, installed) is not None) is note


def test_plots_asked_for_without_matplotlib_names_the_extra():
    with pytest.raises(BenchError, match=re.escape("pip install 'ember[plots]'")):
        resolve_plots(True, installed=False)


# `ember bench` in a fresh interpreter where matplotlib cannot be imported: a
# None in sys.modules is how Python itself marks a module as not importable.
WITHOUT_MATPLOTLIB = "import sys; sys.modules['matplotlib'] = None; from ember.cli import main; sys.exit(main(sys.argv[1:]))"


def ember_without_matplotlib(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", WITHOUT_MATPLOTLIB, *argv], capture_output=True, text=True, timeout=60)


def test_compare_without_matplotlib_writes_markdown_and_says_which_extra(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    save_result(trace_result(), a)
    save_result(trace_result(shift_s=0.5), b)
    done = ember_without_matplotlib("bench", "compare", str(a), str(b), "--out", str(tmp_path / "cmp"))
    assert done.returncode == 0, done.stderr
    assert "pip install 'ember[plots]'" in done.stderr
    assert sorted(p.name for p in (tmp_path / "cmp").iterdir()) == ["compare.md"]
    assert "## Plots" not in (tmp_path / "cmp" / "compare.md").read_text()

    asked = ember_without_matplotlib("bench", "compare", str(a), str(b), "--out", str(tmp_path / "asked"), "--plots")
    assert asked.returncode == 2
    assert "plots need matplotlib" in asked.stderr and "pip install 'ember[plots]'" in asked.stderr
    assert not (tmp_path / "asked").exists()


def test_a_workload_asked_for_plots_without_matplotlib_stops_before_sending(tmp_path):
    # Nothing listens on a fresh free port: an error about the connection would mean load was attempted.
    done = ember_without_matplotlib("bench", "single", "--url", f"http://127.0.0.1:{free_port()}/v1", "--plots",
                                    "--out", str(tmp_path / "out"))
    assert done.returncode == 2
    assert "ember bench single: plots need matplotlib" in done.stderr
    assert not (tmp_path / "out").exists()
