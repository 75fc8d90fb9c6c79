"""`ember bench` against a real `ember serve` (the session's `server` fixture), with tiny workloads.

Every run warms up with one 2-token request, so each test costs a few dozen
generated tokens at most.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ember.cli import main

pytestmark = pytest.mark.timeout(180)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def bench(server: Any, workload: str, out: Path, *args: str) -> int:
    return main(["bench", workload, "--url", server.url, "--out", str(out), "--quiet", *args])


def records_of(out: Path) -> list[dict[str, Any]]:
    return json.loads((out / "requests.json").read_text())


def summary_of(out: Path) -> dict[str, Any]:
    return json.loads((out / "summary.json").read_text())


def assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_MAGIC, path


def test_sweep_writes_json_markdown_and_plots(server, tmp_path):
    out = tmp_path / "sweep"
    assert bench(server, "sweep", out, "--concurrency", "1,2", "--max-tokens", "8", "--requests-per-point", "2",
                 "--slo", "ttft=60,e2e=120") == 0

    records = records_of(out)
    assert len(records) == 4
    assert {r["group"] for r in records} == {"c=1 max_tokens=8", "c=2 max_tokens=8"}
    for r in records:
        assert r["error_kind"] is None and r["status"] == 200
        # Ember is detected, so ignore_eos is sent and every reply runs to max_tokens (exact, from usage).
        assert r["output_tokens"] == 8 and r["output_tokens_source"] == "usage" and r["finish_reason"] == "length"
        times = r["chunk_times_s"]
        assert r["start_s"] < times[0] and times == sorted(times) and times[-1] <= r["end_s"]
        assert 0 < r["ttft_s"] < r["e2e_s"] and r["tpot_s"] > 0

    summary = summary_of(out)
    assert summary["workload"] == "sweep" and summary["config"]["server_is_ember"] is True
    assert summary["config"]["ignore_eos"] is True and summary["config"]["model"]
    groups = {g["label"]: g for g in summary["groups"]}
    point = groups["c=2 max_tokens=8"]
    assert point["params"] == {"concurrency": 2, "max_tokens": 8, "requests": 2}
    s = point["summary"]
    assert s["completed"] == 2 and s["failed"] == 0 and s["output_tokens"] == 16
    assert s["request_throughput"] == pytest.approx(2 / s["duration_s"])
    assert s["good_requests"] == 2 and s["goodput"] == pytest.approx(s["request_throughput"])
    assert s["itl"]["count"] > 0 and s["ttft"]["p99"] >= s["ttft"]["p50"]

    markdown = (out / "summary.md").read_text()
    assert "| c=2 max_tokens=8 | 2/2 |" in markdown and "## Latency" in markdown
    for name in ("latency_cdf", "throughput_vs_concurrency", "latency_vs_max_tokens"):
        assert_png(out / f"{name}.png")
        assert f"![{name}]({name}.png)" in markdown


def test_stream_vs_full(server, tmp_path):
    out = tmp_path / "svf"
    assert bench(server, "stream-vs-full", out, "--pairs", "1", "--max-tokens", "8") == 0
    records = {r["group"]: r for r in records_of(out)}
    streamed, full = records["stream"], records["full"]
    assert streamed["stream"] is True and full["stream"] is False
    assert streamed["output_tokens"] == 8 and full["output_tokens"] == 8
    assert len(streamed["chunk_times_s"]) > 1 and len(full["chunk_times_s"]) == 1
    extras = summary_of(out)["extras"]
    assert extras["first_text_s"] == pytest.approx(streamed["ttft_s"])
    assert extras["full_total_s"] == pytest.approx(full["e2e_s"])
    # The figure is derived from the records; whether streaming wins is a benchmark result, not a
    # test (one pair of 8-token answers on a shared CI machine can go either way).
    assert extras["perceived_latency_cut"] == pytest.approx(1 - streamed["ttft_s"] / full["e2e_s"])
    assert "Streaming cuts the perceived latency" in (out / "summary.md").read_text()
    assert_png(out / "perceived_latency.png")


def test_multiturn_sends_growing_history_with_session_ids(server, tmp_path):
    out = tmp_path / "multiturn"
    assert bench(server, "multiturn", out, "--conversations", "2", "--turns", "2", "--system-tokens", "40",
                 "--max-tokens", "4") == 0
    records = records_of(out)
    assert len(records) == 4 and all(r["error_kind"] is None for r in records)
    for conversation in (0, 1):
        turns = sorted((r for r in records if r["conversation_id"] == conversation), key=lambda r: r["turn"])
        assert [r["turn"] for r in turns] == [1, 2]
        assert len({r["session_id"] for r in turns}) == 1
        # Turn 2 resends turn 1's prompt plus its reply and a new question...
        assert turns[1]["prompt_tokens"] > turns[0]["prompt_tokens"] + turns[0]["output_tokens"]
        # ...and Ember reuses the cached history (usage reports it).
        assert turns[1]["cached_tokens"] > 0
    assert records[0]["session_id"] != records[-1]["session_id"]
    summary = summary_of(out)
    assert set(summary["extras"]["ttft_by_turn"]) == {"1", "2"}
    assert summary["extras"]["ttft_by_turn"]["2"]["count"] == 2
    assert "## TTFT by turn" in (out / "summary.md").read_text()
    assert_png(out / "ttft_by_turn.png")


def test_connection_reuse_and_new_connection_per_request(server, tmp_path):
    pooled, fresh = tmp_path / "pooled", tmp_path / "fresh"
    assert bench(server, "load", pooled, "--concurrency", "1", "--requests", "3", "--max-tokens", "2") == 0
    assert bench(server, "load", fresh, "--concurrency", "1", "--requests", "3", "--max-tokens", "2",
                 "--new-connection-per-request") == 0
    # The warm-up opened the pooled connection; the measured requests reuse it.
    assert [r["connect_s"] for r in records_of(pooled)] == [None, None, None]
    fresh_records = records_of(fresh)
    assert all(r["connect_s"] is not None and r["connect_s"] >= 0 for r in fresh_records)
    assert all(r["tls_s"] is None for r in fresh_records)  # plain http: no TLS handshake
    assert summary_of(fresh)["groups"][0]["summary"]["new_connections"] == 3
    assert "## Connection set-up" in (fresh / "summary.md").read_text()

    # compare on two live result directories
    assert main(["bench", "compare", str(pooled), str(fresh), "--out", str(tmp_path / "cmp"), "--quiet"]) == 0
    assert "## load" in (tmp_path / "cmp" / "compare.md").read_text()
    assert_png(tmp_path / "cmp" / "compare_latency_cdf.png")


def test_open_loop_and_prefill_and_single(server, tmp_path):
    out = tmp_path / "open"
    assert bench(server, "load", out, "--rate", "20", "--requests", "3", "--max-tokens", "2", "--seed", "3") == 0
    records = records_of(out)
    scheduled = [r["scheduled_s"] for r in records]
    assert len(records) == 3 and scheduled == sorted(scheduled) and len(set(scheduled)) == 3
    assert summary_of(out)["groups"][0]["params"]["loop"] == "open"

    out = tmp_path / "prefill"
    assert bench(server, "prefill", out, "--prompt-tokens", "150", "--requests", "2") == 0
    records = records_of(out)
    assert all(r["output_tokens"] == 1 and r["prompt_tokens"] > 150 for r in records)
    # The cache-busting first line leaves at most the shared chat-template header to reuse.
    assert all(r["cached_tokens"] < 32 for r in records)
    assert "prefill_tokens_per_s" in summary_of(out)["extras"]

    out = tmp_path / "single"
    assert bench(server, "single", out, "--requests", "1", "--max-tokens", "6") == 0
    assert summary_of(out)["extras"]["decode_tokens_per_s"]["mean"] > 0


def test_max_tokens_experiment(server, tmp_path):
    out = tmp_path / "max-tokens"
    assert bench(server, "max-tokens", out, "--concurrency", "2", "--max-tokens", "2,6", "--requests-per-point", "2") == 0
    summary = summary_of(out)
    points = summary["extras"]["points"]
    assert [p["max_tokens"] for p in points] == [2, 6]
    assert all(p["mean_output_tokens"] == p["max_tokens"] for p in points)
    # A closed loop keeps between 1 and `concurrency` requests in flight on average.
    assert all(0.5 < p["in_flight"] <= 2.05 for p in points)
    body = json.loads((out / "body-6.json").read_text())
    assert body["max_tokens"] == 6 and "stream" not in body and body["ignore_eos"] is True
    markdown = (out / "summary.md").read_text()
    assert "## Verdict" in markdown and "Little's law" in markdown
    assert "ab -c 2 -n 2 -l -p body-2.json -T application/json " + server.url + "/chat/completions" in markdown
    assert_png(out / "qps_latency_vs_max_tokens.png")
