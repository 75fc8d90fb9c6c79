"""/metrics: parseable, named ember_router_*, low-cardinality labels, current state."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus text page, keyed by (name, sorted labels)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


@pytest.mark.timeout(20)
def test_metrics_page_parses_and_counts_what_happened(upstreams, start_router) -> None:
    a, b = upstreams[0], upstreams[1]
    b.mode = "error500"
    router = start_router([a.url, b.url], policy="round-robin", breaker_failures=1, breaker_open_s=60)
    secret_session = "session-that-must-not-become-a-label"
    for _ in range(4):
        router.chat(session=secret_session, stream=True)
    router.http.post("/v1/chat/completions", content=b"{", headers={"Content-Type": "application/json"})
    response = router.http.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    text = response.text
    families = list(text_string_to_metric_families(text))
    assert families and all(f.name.startswith("ember_router_") for f in families)
    assert secret_session not in text
    values = samples(text)
    assert values[("ember_router_requests_total", (("code", "200"), ("route", "chat")))] == 3
    assert values[("ember_router_requests_total", (("code", "500"), ("route", "chat")))] == 1
    # Round-robin does not parse bodies: the replica's own 400 is passed on.
    assert values[("ember_router_requests_total", (("code", "400"), ("route", "chat")))] == 1
    assert values[("ember_router_upstream_requests_total", (("code", "200"), ("upstream", a.url)))] == 3
    assert values[("ember_router_upstream_requests_total", (("code", "500"), ("upstream", b.url)))] == 1
    assert values[("ember_router_upstream_breaker_state", (("upstream", b.url),))] == 2  # open
    assert values[("ember_router_upstream_breaker_state", (("upstream", a.url),))] == 0
    assert values[("ember_router_upstream_ready", (("upstream", a.url),))] == 1
    assert values[("ember_router_upstream_in_flight", (("upstream", a.url),))] == 0
    # Three streams and the 400 reached a first byte from upstream a.
    assert values[("ember_router_upstream_time_to_first_byte_seconds_count", (("upstream", a.url),))] == 4
    assert values[("ember_router_upstream_request_duration_seconds_count", (("upstream", a.url),))] == 4
    # Round-robin requests carry a session but have no home: no affinity samples.
    assert ("ember_router_session_affinity_total", (("result", "hit"),)) not in values


@pytest.mark.timeout(20)
def test_affinity_hits_and_misses_and_failover_are_counted(upstreams, start_router) -> None:
    from ember.router import rendezvous_order

    a, b = upstreams[0], upstreams[1]
    urls = [a.url, b.url]
    router = start_router(urls)
    at_b = next(f"s{i}" for i in range(1000) if rendezvous_order(f"s{i}", urls)[0] == b.url)
    router.chat(session=at_b)
    router.chat(session=at_b)
    b.mode = "status429"
    router.chat(session=at_b)  # served by a after a retry: a miss
    values = samples(router.http.get("/metrics").text)
    assert values[("ember_router_session_affinity_total", (("result", "hit"),))] == 2
    assert values[("ember_router_session_affinity_total", (("result", "miss"),))] == 1
    assert values[("ember_router_retries_total", (("reason", "status_429"),))] == 1
    assert values[("ember_router_upstream_errors_total", (("kind", "status_429"), ("upstream", b.url)))] == 1


@pytest.mark.timeout(20)
def test_removed_upstream_leaves_no_series_behind(upstreams, start_router) -> None:
    a, b = upstreams[0], upstreams[1]
    router = start_router([a.url, b.url], policy="round-robin")
    for _ in range(4):
        router.chat()
    assert b.url in router.http.get("/metrics").text
    router.http.delete("/admin/upstreams", params={"url": b.url})
    text = router.http.get("/metrics").text
    assert b.url not in text and a.url in text
