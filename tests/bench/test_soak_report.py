"""The soak's figures and verdict, from made-up records and samples (benchmarks/soak_report.py is pure)."""

from __future__ import annotations

import pytest

from benchmarks.soak_report import MB, ResourceSample, SoakRequest, per_minute, percentile, render_markdown, slope_per_min, verdict


def req(started_s: float, e2e_s: float = 1.0, *, ttft_s: float | None = 0.1, error: str | None = None, cancelled: bool = False) -> SoakRequest:
    return SoakRequest("stream", started_s, e2e_s, ttft_s, 0 if error else 200, cancelled, error)


def samples(minutes: int, rss_mb_per_min: float, warm_mb_per_min: float = 0.0, fds: int = 20, every_s: float = 30.0) -> list[ResourceSample]:
    out = []
    t = 0.0
    while t <= minutes * 60:
        out.append(ResourceSample(t, int((1000 + rss_mb_per_min * t / 60) * MB), fds, int(warm_mb_per_min * t / 60 * MB)))
        t += every_s
    return out


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50 and percentile(values, 99) == 99 and percentile(values, 100) == 100
    assert percentile([], 50) is None


def test_per_minute_counts_errors_and_cancellations_and_keeps_them_out_of_latency() -> None:
    rows = per_minute([req(1, 1.0), req(2, 3.0), req(30, 50.0, cancelled=True), req(61, 2.0, error="http 500"), req(119, 0.5)])
    assert [(m.minute, m.requests, m.errors, m.cancelled) for m in rows] == [(0, 3, 0, 1), (1, 2, 1, 0)]
    assert rows[0].p99_e2e_s == 3.0  # the cancelled 50 s is not a latency
    assert rows[1].p50_e2e_s == 0.5 and rows[1].p99_e2e_s == 0.5  # nor is the failed one


def test_slope_is_per_minute() -> None:
    assert slope_per_min([(0.0, 10.0), (60.0, 12.0), (120.0, 14.0)]) == pytest.approx(2.0)
    assert slope_per_min([(0.0, 10.0)]) is None


def test_the_warm_tier_filling_its_budget_is_not_a_leak() -> None:
    # Issue 14's 20-minute run: RSS +46 MB/min, about all of it the warm tier.
    result = verdict([req(t) for t in range(0, 1200, 5)], samples(20, rss_mb_per_min=46, warm_mb_per_min=45.5), warmup_s=120, budget_bytes=1024 * MB)
    assert result.raw_slope_mb_per_min == pytest.approx(46, abs=0.1)
    assert result.net_slope_mb_per_min == pytest.approx(0.5, abs=0.1)
    assert result.passed, result.checks


def test_a_leak_fails_and_so_do_errors_rss_over_budget_and_growing_fds() -> None:
    leak = verdict([req(1)], samples(30, rss_mb_per_min=5), warmup_s=120, budget_bytes=1024 * MB)
    assert not leak.checks["net RSS slope <= 2 MB/min"] and not leak.passed
    errors = verdict([req(1), req(2, error="http 500")], samples(5, 0), warmup_s=60, budget_bytes=MB)
    assert errors.errors == 1 and not errors.checks["no errors"]
    over = verdict([req(1)], samples(5, rss_mb_per_min=1.5), warmup_s=0, budget_bytes=2 * MB)
    assert not over.checks["raw RSS within the budgets"]
    fds = verdict([req(1)], [ResourceSample(t, 1000 * MB, 20 + int(t // 10), 0) for t in range(0, 600, 30)], warmup_s=0, budget_bytes=MB)
    assert not fds.checks["fds flat"] and fds.checks["no errors"]


def test_cancellations_are_not_errors() -> None:
    result = verdict([req(1, cancelled=True), req(2)], samples(5, 0), warmup_s=0, budget_bytes=MB)
    assert result.errors == 0 and result.passed


def test_the_report_names_every_check() -> None:
    requests = [req(t) for t in range(0, 300, 3)]
    result = verdict(requests, samples(5, 0.5), warmup_s=60, budget_bytes=64 * MB)
    text = render_markdown(requests, samples(5, 0.5), result, config={"duration_s": 300, "warmup_s": 60})
    for name in result.checks:
        assert f"PASS: {name}" in text
    assert "| 4 |" in text and text.rstrip().endswith("**PASS**")
