"""Health: circuit breakers, draining, probes, run-time membership, config reloads."""

from __future__ import annotations

import asyncio
import json
import os
import time

import httpx
import pytest
from router_fakes import FakeUpstream, streamed_text, wait_until

from ember.router import RouterConfig, create_router_app, rendezvous_order


@pytest.mark.timeout(20)
def test_breaker_opens_on_an_upstream_answering_500s_and_routes_around_it(upstreams, start_router) -> None:
    a, b = upstreams[0], upstreams[1]
    b.mode = "error500"
    router = start_router([a.url, b.url], policy="round-robin", breaker_failures=2, breaker_open_s=60)
    statuses = [router.chat().status_code for _ in range(10)]
    assert len(b.completions_seen()) == 2  # two failures, then the breaker took it out
    assert statuses.count(500) == 2 and statuses[-6:] == [200] * 6
    state = router.upstream_state(b.url)
    assert state["breaker"] == "open" and state["available"] is False and state["ready"] is True
    assert router.http.get("/ready").json()["available_upstreams"] == 1


@pytest.mark.timeout(20)
def test_breaker_opens_on_an_upstream_that_accepts_then_stalls(upstreams, start_router) -> None:
    a, b = upstreams[0], upstreams[1]
    b.mode = "stall"
    router = start_router([a.url, b.url], policy="round-robin", breaker_failures=2, stall_timeout_s=0.25)
    for _ in range(8):
        response = router.chat(stream=True)
        # Failed over: the client never sees the stalling replica.
        assert response.status_code == 200 and streamed_text(response.text) == "Hello from a!"
    assert len(b.completions_seen()) == 2
    assert router.upstream_state(b.url)["breaker"] == "open"


@pytest.mark.timeout(20)
def test_open_breaker_lets_one_trial_through_after_the_open_time(upstreams, start_router, fake_clock) -> None:
    a, b = upstreams[0], upstreams[1]
    b.mode = "error500"
    router = start_router([a.url, b.url], clock=fake_clock, policy="round-robin", breaker_failures=1, breaker_open_s=30)
    router.chat()
    router.chat()
    assert router.upstream_state(b.url)["breaker"] == "open"
    b.mode = "ok"
    for _ in range(4):
        router.chat()
    assert len(b.completions_seen()) == 1  # still open: no traffic
    fake_clock.advance(30)
    assert router.upstream_state(b.url)["breaker"] == "half_open"
    for _ in range(4):
        assert router.chat().status_code == 200
    assert router.upstream_state(b.url)["breaker"] == "closed"  # the trial succeeded
    assert len(b.completions_seen()) == 3  # the trial, then its round-robin share


@pytest.mark.timeout(20)
def test_draining_replica_gets_no_new_traffic_and_comes_back(upstreams, start_router) -> None:
    urls = [fake.url for fake in upstreams]
    a, b, c = upstreams
    router = start_router(urls, probe_interval_s=0.05)
    b.ready_status = 503
    wait_until(lambda: router.upstream_state(b.url)["ready"] is False)
    sessions = [f"u{i}" for i in range(30)]
    homed_at_b = [s for s in sessions if rendezvous_order(s, urls)[0] == b.url]
    assert homed_at_b
    for session in sessions:
        assert router.chat(session=session).status_code == 200
    assert b.completions_seen() == []
    # Back in service: its sessions move back to it (their rendezvous home).
    b.ready_status = 200
    wait_until(lambda: router.upstream_state(b.url)["ready"] is True)
    for session in homed_at_b:
        router.chat(session=session)
    assert sorted(r.headers["x-session-id"] for r in b.completions_seen()) == sorted(homed_at_b)


@pytest.mark.timeout(30)
def test_session_moves_when_its_replica_dies_and_returns_when_it_is_back(upstreams, start_router) -> None:
    a = upstreams[0]
    home = FakeUpstream("home")
    port = home.port
    urls = [a.url, home.url]
    session = next(f"s{i}" for i in range(1000) if rendezvous_order(f"s{i}", urls)[0] == home.url)
    router = start_router(urls, probe_interval_s=0.05)
    try:
        assert router.chat(session=session).headers["x-upstream"] == "home"
        home.stop()
        # Its next turns go to the next replica on its ring (failover, then probes keep it there).
        assert router.chat(session=session).headers["x-upstream"] == "a"
        wait_until(lambda: router.upstream_state(home.url)["ready"] is False)
        assert router.chat(session=session).headers["x-upstream"] == "a"
        home = FakeUpstream("home", port=port)  # restarted at the same address
        wait_until(lambda: router.upstream_state(home.url)["ready"] is True)
        assert router.chat(session=session).headers["x-upstream"] == "home"
    finally:
        home.stop()


@pytest.mark.timeout(20)
def test_upstreams_are_added_and_removed_at_run_time(upstreams, start_router) -> None:
    a, b = upstreams[0], upstreams[1]
    router = start_router([a.url], policy="round-robin")
    added = router.http.post("/admin/upstreams", json={"url": b.url + "/v1"})
    assert added.status_code == 201 and added.json()["url"] == b.url and added.json()["ready"] is True
    assert router.http.post("/admin/upstreams", json={"url": b.url}).status_code == 200  # already there
    for _ in range(4):
        router.chat()
    assert len(a.completions_seen()) == 2 and len(b.completions_seen()) == 2
    assert router.http.request("DELETE", "/admin/upstreams", json={"url": a.url}).json() == {"removed": a.url}
    for _ in range(4):
        router.chat()
    assert len(a.completions_seen()) == 2 and len(b.completions_seen()) == 6
    assert router.http.delete("/admin/upstreams", params={"url": a.url}).status_code == 404
    bad = router.http.post("/admin/upstreams", json={"url": "not a url"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "url"
    listing = router.http.get("/admin/upstreams").json()
    assert listing["policy"] == "round-robin" and [u["url"] for u in listing["upstreams"]] == [b.url]


@pytest.mark.timeout(20)
def test_admin_endpoints_require_the_admin_key_when_set(upstreams, start_router) -> None:
    router = start_router([upstreams[0].url], admin_key="s3cret")
    assert router.http.get("/admin/upstreams").status_code == 401
    assert router.http.get("/admin/upstreams", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert router.http.get("/admin/upstreams", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert router.http.get("/admin/upstreams", headers={"X-Admin-Key": "s3cret"}).status_code == 200
    # The admin key is the router's own: it is not required on the API.
    assert router.chat().status_code == 200


@pytest.mark.timeout(20)
def test_without_an_admin_key_admin_answers_loopback_clients_only() -> None:
    app = create_router_app(RouterConfig(upstreams=("http://10.9.9.9:8000",)))

    async def status_for(client_ip: str) -> int:
        transport = httpx.ASGITransport(app=app, client=(client_ip, 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            return (await client.get("/admin/upstreams")).status_code

    assert asyncio.run(status_for("10.1.2.3")) == 403
    assert asyncio.run(status_for("127.0.0.1")) == 200
    assert asyncio.run(status_for("::1")) == 200


@pytest.mark.timeout(20)
def test_upstreams_file_is_reloaded_when_it_changes(upstreams, start_router, tmp_path) -> None:
    a, b = upstreams[0], upstreams[1]
    path = tmp_path / "upstreams.json"
    path.write_text(json.dumps({"upstreams": [a.url]}))
    router = start_router([], config_file=str(path), probe_interval_s=0.05)
    assert [u["url"] for u in router.http.get("/admin/upstreams").json()["upstreams"]] == [a.url]

    def rewrite(text: str) -> None:
        path.write_text(text)
        later = time.time_ns() + 10_000_000_000
        os.utime(path, ns=(later, later))  # a new mtime even on coarse file systems

    def listed() -> list[str]:
        return [u["url"] for u in router.http.get("/admin/upstreams").json()["upstreams"]]

    rewrite(json.dumps([a.url, b.url]))
    wait_until(lambda: listed() == [a.url, b.url])
    rewrite("{broken")
    wait_until(lambda: 'ember_router_config_reloads_total{result="error"} 1.0' in router.http.get("/metrics").text)
    assert listed() == [a.url, b.url]  # a bad file keeps the current set
    rewrite(json.dumps([b.url]))
    wait_until(lambda: listed() == [b.url])
    assert router.chat().headers["x-upstream"] == "b"


@pytest.mark.timeout(20)
def test_router_health_and_readiness(upstreams, start_router) -> None:
    a = upstreams[0]
    router = start_router([a.url], probe_interval_s=0.05)
    assert router.http.get("/health").json() == {"status": "ok"}
    assert router.http.get("/ready").status_code == 200
    a.ready_status = 503
    wait_until(lambda: router.http.get("/ready").status_code == 503)
    not_ready = router.http.get("/ready")
    assert not_ready.headers["retry-after"] == "1" and not_ready.json()["error"]["code"] == "no_upstream_available"
