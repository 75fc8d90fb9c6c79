"""`python -m benchmarks kv-cache`, shrunk: both servers and both in-process engines run both workloads and it reports them."""

from __future__ import annotations

import json

import pytest

from benchmarks.cli import main


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_kv_cache_bench_reports_both_caches_on_every_path(tmp_path, capsys):
    out = tmp_path / "kv-cache.json"
    args = ["kv-cache", "--rounds", "1", "--streams", "2", "--tokens", "8", "--long-words", "60", "--out", str(out)]
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert set(report["median"]) == {"HTTP, float32", "HTTP, float16", "in process, float32", "in process, float16"}
    for name, by_workload in report["median"].items():
        assert by_workload["long"]["prompt_tokens"] > by_workload["short"]["prompt_tokens"] + 50
        assert all(figures["output_tps"] > 0 for figures in by_workload.values())
        if name.startswith("in process"):
            assert all(figures["decode_step_ms"] > 0 for figures in by_workload.values())
    printed = capsys.readouterr().out
    assert "| long | HTTP |" in printed and "| short | in process |" in printed
    assert set(report["identical_share"]) == {"short", "long"}
