"""`python -m benchmarks engine` with tiny parameters: it runs and reports."""

from __future__ import annotations

import json

import pytest

from benchmarks.cli import main


@pytest.mark.timeout(300)
def test_engine_bench_writes_figures(tmp_path, capsys):
    out = tmp_path / "engine.json"
    assert main(["engine", "--no-reference", "--decode-tokens", "8", "--prefill-tokens", "64",
                 "--concurrency", "2", "--aggregate-tokens", "4", "--out", str(out)]) == 0
    figures = json.loads(out.read_text())["ember"][0]
    assert figures["mode"] == "float32/int8"
    for key in ("decode_tps", "prefill_tps", "aggregate_tps", "step_overhead_ms"):
        assert figures[key] > 0, key
    assert "target" in capsys.readouterr().out
