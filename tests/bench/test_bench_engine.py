"""`ember bench engine` and `ember bench server-overhead` with tiny parameters: they run and report."""

from __future__ import annotations

import json

import pytest

from ember.cli import main


@pytest.mark.timeout(300)
def test_engine_bench_writes_figures(tmp_path, capsys):
    out = tmp_path / "engine.json"
    assert main(["bench", "engine", "--no-reference", "--decode-tokens", "8", "--prefill-tokens", "64",
                 "--concurrency", "2", "--aggregate-tokens", "4", "--out", str(out)]) == 0
    figures = json.loads(out.read_text())["ember"][0]
    assert figures["mode"] == "float32/int8"
    for key in ("decode_tps", "prefill_tps", "aggregate_tps", "step_overhead_ms"):
        assert figures[key] > 0, key
    assert "target" in capsys.readouterr().out


@pytest.mark.timeout(300)
def test_server_overhead_bench_reports_all_three_figures(tmp_path, capsys):
    assert main(["bench", "server-overhead", "--requests", "3", "--concurrency", "2", "--max-tokens", "4", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "overhead.md").read_text()
    for row in ("TTFT p50", "2 streams, tokens/s", "SSE framing per chunk"):
        assert row in report
