"""Bench metrics against values computed by hand on a recorded trace (data/bench_trace.json).

The trace, times in seconds from the run's start:

    #  start  text chunks at        end   output  prompt  outcome
    0  0.0    0.5 0.6 0.8 1.0       1.1   5       100     ok (length), new TCP 3 ms + TLS 10 ms
    1  0.2    0.4 0.7 1.3           1.4   3       50      ok (stop), new TCP 5 ms
    2  1.0    2.0                   2.0   1       80      ok (length)
    3  1.5    -                     1.51  -       -       HTTP 429
    4  2.0    2.5                   4.0   -       -       client timeout
    5  2.5    2.9 3.1               3.5   2       70      ok (length, stop_reason timeout)

Per successful request (0, 1, 2, 5):
    TTFT = first chunk - start:        0.5, 0.2, 1.0, 0.4
    E2E  = end - start:                1.1, 1.2, 1.0, 1.0
    TPOT = (E2E - TTFT) / (out - 1):   0.6/4 = 0.15, 1.0/2 = 0.5, none (1 token), 0.6/1 = 0.6
    ITL  = chunk gaps:                 [0.1, 0.2, 0.2], [0.3, 0.6], [], [0.2]
Percentiles interpolate linearly: the p-th of n sorted values sits at rank (n - 1) * p / 100.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ember.bench.metrics import SLO, Stats, describe, parse_slo, percentile, span_s, stats_by, summarize
from ember.bench.record import RequestRecord, load_records, save_records

pytestmark = pytest.mark.timeout(30)

TRACE = Path(__file__).parent / "data" / "bench_trace.json"
DURATION_S = 5.0


@pytest.fixture
def records() -> list[RequestRecord]:
    return load_records(TRACE)


def approx_stats(stats: Stats, count: int, mean: float, p50: float, p90: float, p99: float) -> None:
    assert stats.count == count
    assert (stats.mean, stats.p50, stats.p90, stats.p99) == pytest.approx((mean, p50, p90, p99), abs=1e-9)


def test_per_request_latencies(records):
    by_index = {r.index: r for r in records}
    assert [by_index[i].ttft_s for i in (0, 1, 2, 5)] == pytest.approx([0.5, 0.2, 1.0, 0.4])
    assert [by_index[i].e2e_s for i in (0, 1, 2, 5)] == pytest.approx([1.1, 1.2, 1.0, 1.0])
    assert by_index[0].tpot_s == pytest.approx(0.15)
    assert by_index[1].tpot_s == pytest.approx(0.5)
    assert by_index[2].tpot_s is None  # one output token: no time "per output token after the first"
    assert by_index[5].tpot_s == pytest.approx(0.6)
    assert by_index[4].tpot_s is None  # failed
    assert by_index[0].itl_s == pytest.approx([0.1, 0.2, 0.2])
    assert by_index[2].itl_s == []
    assert [r.ok for r in records] == [True, True, True, False, False, True]


def test_summary_counts_and_throughput(records):
    s = summarize(records, DURATION_S)
    assert (s.requests, s.completed, s.failed) == (6, 4, 2)
    assert s.errors_by_kind == {"http_429": 1, "timeout": 1}
    assert s.prompt_tokens == 100 + 50 + 80 + 70
    assert s.output_tokens == 5 + 3 + 1 + 2
    assert s.request_throughput == pytest.approx(4 / 5.0)
    assert s.output_throughput == pytest.approx(11 / 5.0)
    assert s.total_token_throughput == pytest.approx(311 / 5.0)
    assert s.finish_reasons == {"length": 2, "length/timeout": 1, "stop": 1}
    assert s.goodput is None and s.good_requests is None  # no SLO given


def test_summary_latency_statistics(records):
    s = summarize(records, DURATION_S)
    # TTFT sorted 0.2 0.4 0.5 1.0: mean 2.1/4; p50 at rank 1.5 = 0.4 + 0.5*0.1; p90 at 2.7 = 0.5 + 0.7*0.5;
    # p99 at 2.97 = 0.5 + 0.97*0.5.
    approx_stats(s.ttft, 4, 0.525, 0.45, 0.85, 0.985)
    # TPOT sorted 0.15 0.5 0.6: mean 1.25/3; p50 = 0.5; p90 at 1.8 = 0.5 + 0.8*0.1; p99 at 1.98 = 0.5 + 0.98*0.1.
    approx_stats(s.tpot, 3, 1.25 / 3, 0.5, 0.58, 0.598)
    # ITL pooled, sorted 0.1 0.2 0.2 0.2 0.3 0.6: mean 1.6/6; p50 at 2.5 = 0.2; p90 at 4.5 = 0.3 + 0.5*0.3;
    # p99 at 4.95 = 0.3 + 0.95*0.3. The failed request's chunk is not counted.
    approx_stats(s.itl, 6, 1.6 / 6, 0.2, 0.45, 0.585)
    # E2E sorted 1.0 1.0 1.1 1.2: mean 4.3/4; p50 at 1.5 = 1.05; p90 at 2.7 = 1.17; p99 at 2.97 = 1.197.
    approx_stats(s.e2e, 4, 1.075, 1.05, 1.17, 1.197)


def test_goodput_under_slos(records):
    # ttft <= 0.5 and e2e <= 1.15: #0 (0.5, 1.1) yes, #1 (e2e 1.2) no, #2 (ttft 1.0) no, #5 (0.4, 1.0) yes.
    s = summarize(records, DURATION_S, parse_slo("ttft=0.5,e2e=1.15"))
    assert s.good_requests == 2 and s.goodput == pytest.approx(2 / 5.0)
    assert s.slo == {"ttft_s": 0.5, "e2e_s": 1.15}
    # tpot <= 0.55: #0 (0.15) and #1 (0.5) yes; #2 has no TPOT, so it cannot meet it; #5 (0.6) no.
    assert summarize(records, DURATION_S, SLO(tpot_s=0.55)).good_requests == 2
    # All three at once: only #0.
    combined = summarize(records, DURATION_S, parse_slo("ttft=500ms,tpot=0.55,e2e=1.15s"))
    assert combined.good_requests == 1 and combined.goodput == pytest.approx(0.2)


def test_connection_setup_stats(records):
    s = summarize(records, DURATION_S)
    assert s.new_connections == 2
    approx_stats(s.connect, 2, 0.004, 0.004, 0.0048, 0.00498)
    approx_stats(s.tls, 1, 0.01, 0.01, 0.01, 0.01)


def test_duration_defaults_to_the_span(records):
    assert span_s(records) == pytest.approx(4.0)  # first start 0.0, last end 4.0 (the timed-out request)
    assert summarize(records).request_throughput == pytest.approx(4 / 4.0)


def test_ttft_by_turn(records):
    by_turn = stats_by(records, lambda r: r.turn, lambda r: r.ttft_s)
    assert list(by_turn) == [1, 2]  # turn 3 only has a failed request
    approx_stats(by_turn[1], 2, 0.35, 0.35, 0.47, 0.497)  # 0.2, 0.5
    approx_stats(by_turn[2], 2, 0.7, 0.7, 0.94, 0.994)  # 1.0 (#2), 0.4 (#5)


def test_percentile_and_describe_edge_cases():
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([0.0, 10.0], 90) == pytest.approx(9.0)
    assert describe([]) == Stats(count=0)
    with pytest.raises(ValueError):
        percentile([], 50)
    empty = summarize([], 0.0)
    assert empty.completed == 0 and empty.ttft.mean is None


@pytest.mark.parametrize("text", ["ttft", "ttft=", "foo=1", "ttft=-1", "ttft=1min"])
def test_parse_slo_rejects_bad_items(text):
    with pytest.raises(ValueError):
        parse_slo(text)


def test_parse_slo_units():
    assert parse_slo("ttft=0.5, e2e=5") == SLO(ttft_s=0.5, e2e_s=5.0)
    assert parse_slo("tpot=50ms") == SLO(tpot_s=0.05)
    assert parse_slo("") == SLO() and SLO().empty


def test_records_round_trip(records, tmp_path):
    path = tmp_path / "requests.json"
    save_records(records, path)
    assert load_records(path) == records
