"""The max-tokens experiment's verdict (Little's law) and its Apache Bench helpers."""

from __future__ import annotations

import pytest

from ember.bench.maxtokens import Point, ab_command, latency_rise_for_qps_drop, parse_ab, points_table, verdict

pytestmark = pytest.mark.timeout(30)

AB_OUTPUT = """\
Server Software:        uvicorn
Document Path:          /v1/chat/completions
Concurrency Level:      10
Time taken for tests:   12.345 seconds
Complete requests:      100
Failed requests:        0
Non-2xx responses:      3
Requests per second:    8.10 [#/sec] (mean)
Time per request:       1234.500 [ms] (mean)
Time per request:       123.450 [ms] (mean, across all concurrent requests)
"""


def test_littles_law_bounds():
    # At fixed L, QPS x latency is constant: a 40 % drop means latency x 1/0.6, a 60 % drop x 1/0.4.
    assert latency_rise_for_qps_drop(0.4) == pytest.approx(2 / 3)
    assert latency_rise_for_qps_drop(0.6) == pytest.approx(1.5)
    assert latency_rise_for_qps_drop(0.0) == 0.0


def test_verdict_when_latency_scales_with_length():
    # A decode-bound server: latency doubles with max_tokens, QPS halves, L stays at 10.
    points = [Point(50, 2.0, 5.0, 50.0), Point(100, 1.0, 10.0, 100.0), Point(200, 0.5, 20.0, 200.0)]
    text = verdict(points, concurrency=10)
    assert "QPS fell by **75.0 %** (claim 40–60 %: does not hold)" in text
    assert "mean latency rose by **300.0 %** (claim ~30 %, read as 20–40 %: does not hold)" in text
    assert "Measured λW per point: 10.00, 10.00, 10.00 requests in flight (concurrency 10)" in text
    assert "predicts a latency rise of 300.0 %; measured 300.0 %" in text
    assert "66.7 %–150.0 %" in text and "23.1 % QPS drop" in text
    assert "Caution" not in text


def test_verdict_reports_each_half_of_the_claim_separately():
    # Numbers that match the claim (impossible in a closed loop: λW falls from 10 to 6.5).
    points = [Point(50, 2.0, 5.0, 50.0), Point(200, 1.0, 6.5, 120.0)]
    text = verdict(points, concurrency=10)
    assert "QPS fell by **50.0 %** (claim 40–60 %: holds)" in text
    assert "rose by **30.0 %** (claim ~30 %, read as 20–40 %: holds)" in text
    assert "10.00, 6.50 requests in flight" in text
    assert "predicts a latency rise of 100.0 %; measured 30.0 %" in text
    # 120 of 200 tokens: the model stopped early, so the comparison is flagged.
    assert "Caution: replies stopped before max_tokens at 200 (mean 120 tokens)" in text


def test_points_table_changes_against_the_first():
    table = points_table([Point(50, 2.0, 5.0, 50.0), Point(100, 1.2, 8.0, 100.0)])
    assert "| 100 | 1.20 | 8000.0 | -40.0 % | +60.0 % | 100.0 | 9.60 |" in table


def test_ab_command_and_output_parsing():
    command = ab_command("body-50.json", 10, 100, "http://127.0.0.1:8000/v1/", "sk-1")
    assert command == ["ab", "-c", "10", "-n", "100", "-l", "-p", "body-50.json", "-T", "application/json",
                       "-H", "Authorization: Bearer sk-1", "http://127.0.0.1:8000/v1/chat/completions"]
    assert parse_ab(AB_OUTPUT) == {"qps": 8.10, "mean_latency_s": pytest.approx(1.2345), "non_2xx": 3.0}
    with pytest.raises(ValueError):
        parse_ab("apr_socket_connect(): Connection refused (111)")
