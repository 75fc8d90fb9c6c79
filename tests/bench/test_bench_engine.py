"""`python -m benchmarks engine` with tiny parameters: it runs and reports."""

from __future__ import annotations

import json

import pytest

from benchmarks.cli import main


@pytest.mark.timeout(480)
def test_engine_bench_writes_figures(tmp_path, capsys):
    out = tmp_path / "engine.json"
    assert main(["engine", "--no-reference", "--decode-tokens", "8", "--prefill-tokens", "64",
                 "--concurrency", "2", "--aggregate-tokens", "4", "--repeats", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["ember"]
    assert [r["mode"] for r in rows] == [
        "float32/int8, batch-invariant",
        "float32/int8, previous default (AMX weight tiles gathered first, torch argmax)",
        "float32/int8, previous kernels",
    ]
    for figures in rows:
        for key in ("decode_tps", "prefill_tps", "aggregate_tps", "aggregate_sampled_tps", "sampled_vs_greedy", "step_overhead_ms", "weight_bytes_per_param"):
            assert figures[key] > 0, key
        assert figures["rss_mb"]["weights"] > 0 and figures["rss_mb"]["kv_pool"] > 0
    printed = capsys.readouterr().out
    assert "target" in printed and "(same run)" in printed
