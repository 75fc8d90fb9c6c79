"""Replica set bookkeeping and /ready probes (httpx.MockTransport, no sockets)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from ember.router.breaker import BreakerState
from ember.router.replicas import ReplicaSet, Verdict, probe


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.timeout(5)
def test_in_flight_counts_and_breaker_verdicts() -> None:
    clock = Clock()
    replicas = ReplicaSet(["http://a", "http://b"], breaker_failures=2, breaker_open_s=30.0, clock=clock)
    a = replicas.get("http://a")
    assert a is not None and a.try_begin() and a.try_begin()
    assert replicas.snapshots()[0].in_flight == 2
    a.end(Verdict.FAILURE)
    a.end(Verdict.FAILURE)
    assert a.in_flight == 0 and a.breaker.state is BreakerState.OPEN
    assert [s.available for s in replicas.snapshots()] == [False, True]
    assert not a.try_begin() and a.in_flight == 0
    clock.now = 30.0
    assert a.try_begin()  # the half-open trial
    a.end(Verdict.NEUTRAL)  # client left: slot released, state unchanged
    assert a.breaker.state is BreakerState.HALF_OPEN
    assert a.try_begin()
    a.end(Verdict.SUCCESS)
    assert a.breaker.state is BreakerState.CLOSED and replicas.available_count() == 2


@pytest.mark.timeout(5)
def test_not_ready_replica_is_unavailable_and_refuses_attempts() -> None:
    replicas = ReplicaSet(["http://a"])
    a = replicas.get("http://a")
    assert a is not None
    a.set_ready(False, "draining")
    assert not replicas.snapshots()[0].available and not a.try_begin()
    assert a.describe()["not_ready_reason"] == "draining"
    a.set_ready(True)
    assert replicas.snapshots()[0].available and a.describe()["not_ready_reason"] is None


@pytest.mark.timeout(5)
def test_replace_keeps_known_replicas_and_their_state() -> None:
    replicas = ReplicaSet(["http://a", "http://b"])
    a = replicas.get("http://a")
    assert a is not None and a.try_begin()
    added, removed = replicas.replace(["http://c", "http://a"])
    assert (added, removed) == (["http://c"], ["http://b"])
    assert replicas.urls() == ("http://a", "http://c")
    assert replicas.get("http://a") is a and a.in_flight == 1
    assert replicas.add("http://a") is a
    assert replicas.remove("http://c") and not replicas.remove("http://c")


@pytest.mark.timeout(5)
@pytest.mark.parametrize(
    ("answer", "ready"),
    [(200, True), (404, True), (429, True), (503, False), (500, False), ("refused", False), ("timeout", False)],
)
def test_probe_judges_readiness(answer: int | str, ready: bool) -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        if answer == "refused":
            raise httpx.ConnectError("refused", request=request)
        if answer == "timeout":
            raise httpx.ReadTimeout("slow", request=request)
        return httpx.Response(answer)

    replicas = ReplicaSet(["http://a:8000"])
    replica = replicas.get("http://a:8000")
    assert replica is not None

    async def run() -> bool:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await probe(replica, client, timeout_s=0.5)

    assert asyncio.run(run()) is ready
    assert replica.ready is ready
    assert seen == ["http://a:8000/ready"]
    # Probes say nothing to the breaker: only real traffic opens or closes it.
    assert replica.breaker.consecutive_failures == 0
