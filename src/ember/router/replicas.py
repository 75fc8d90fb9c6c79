"""The set of upstream replicas: readiness, circuit breakers, in-flight counts, probes.

All state here lives on the router's event loop thread and is mutated only
there, so no locks are needed. The routing policy never sees a ``Replica``;
it gets immutable ``ReplicaSnapshot``s from ``ReplicaSet.snapshots()``.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Iterable, Iterator

import httpx

from ember.router.breaker import BreakerState, CircuitBreaker
from ember.router.policy import ReplicaSnapshot

logger = logging.getLogger("ember.router")


class Verdict(enum.Enum):
    """What one finished attempt says about the replica's health."""

    SUCCESS = "success"  # answered (a 4xx is the client's fault, still a success)
    FAILURE = "failure"  # connection error, stall, 5xx, broken stream
    NEUTRAL = "neutral"  # no evidence either way: 429, 503 (draining), client left


class Replica:
    """One upstream and what the router knows about it.

    Invariant: ``in_flight`` counts attempts between ``try_begin()`` returning
    True and the matching ``end()``; every successful ``try_begin`` is ended
    exactly once, so the count never drifts.
    """

    def __init__(self, url: str, breaker: CircuitBreaker) -> None:
        self.url = url
        self.breaker = breaker
        # Optimistic until the first probe: a fresh router serves at once and
        # failover covers a replica that turns out to be down.
        self.ready = True
        self.not_ready_reason: str | None = None
        self.in_flight = 0

    def snapshot(self) -> ReplicaSnapshot:
        """An immutable view for the routing policy."""
        return ReplicaSnapshot(self.url, self.ready and self.breaker.allows_request(), self.in_flight)

    def try_begin(self) -> bool:
        """Start an attempt if the replica is ready and its breaker lets it through."""
        if not self.ready or not self.breaker.try_acquire():
            return False
        self.in_flight += 1
        return True

    def end(self, verdict: Verdict) -> None:
        """Finish an attempt started by ``try_begin`` and feed the breaker."""
        self.in_flight -= 1
        if verdict is Verdict.SUCCESS:
            self.breaker.record_success()
        elif verdict is Verdict.FAILURE:
            self.breaker.record_failure()
        else:
            self.breaker.release()

    def set_ready(self, ready: bool, reason: str | None = None) -> None:
        """Record the latest readiness evidence (a probe, or a 503 from a request)."""
        if ready != self.ready:
            if ready:
                logger.info("upstream %s is ready", self.url)
            else:
                logger.warning("upstream %s is not ready: %s", self.url, reason)
        self.ready = ready
        self.not_ready_reason = None if ready else reason

    def describe(self) -> dict[str, object]:
        """JSON-able state for the admin endpoint."""
        breaker = self.breaker
        return {
            "url": self.url,
            "ready": self.ready,
            "not_ready_reason": self.not_ready_reason,
            "breaker": breaker.state.value,
            "consecutive_failures": breaker.consecutive_failures,
            "in_flight": self.in_flight,
            "available": self.snapshot().available,
        }


class ReplicaSet:
    """The replicas the router may use, in the order they were added."""

    def __init__(
        self,
        urls: Iterable[str] = (),
        *,
        breaker_failures: int = 5,
        breaker_open_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._breaker_failures = breaker_failures
        self._breaker_open_s = breaker_open_s
        self._clock = clock
        self._replicas: dict[str, Replica] = {}
        for url in urls:
            self.add(url)

    def __len__(self) -> int:
        return len(self._replicas)

    def __iter__(self) -> Iterator[Replica]:
        # A copy: callers may add or remove replicas while iterating.
        return iter(list(self._replicas.values()))

    def get(self, url: str) -> Replica | None:
        return self._replicas.get(url)

    def urls(self) -> tuple[str, ...]:
        return tuple(self._replicas)

    def snapshots(self) -> tuple[ReplicaSnapshot, ...]:
        """One immutable snapshot per replica, for ``policy.choose``."""
        return tuple(r.snapshot() for r in self._replicas.values())

    def available_count(self) -> int:
        return sum(1 for r in self._replicas.values() if r.snapshot().available)

    def add(self, url: str) -> Replica:
        """Add a replica (URL already normalized); adding a known URL returns the existing one."""
        existing = self._replicas.get(url)
        if existing is not None:
            return existing

        def log_change(old: BreakerState, new: BreakerState) -> None:
            logger.warning("upstream %s circuit breaker %s -> %s", url, old.value, new.value)

        breaker = CircuitBreaker(self._breaker_failures, self._breaker_open_s, self._clock, log_change)
        replica = Replica(url, breaker)
        self._replicas[url] = replica
        logger.info("upstream %s added", url)
        return replica

    def remove(self, url: str) -> bool:
        """Stop routing to a replica. Requests already on it finish normally."""
        if self._replicas.pop(url, None) is None:
            return False
        logger.info("upstream %s removed", url)
        return True

    def replace(self, urls: Iterable[str]) -> tuple[list[str], list[str]]:
        """Make the set exactly ``urls``, keeping the state of replicas already known.

        Returns (added, removed) URLs.
        """
        wanted = list(dict.fromkeys(urls))
        removed = [url for url in self._replicas if url not in wanted]
        added = [url for url in wanted if url not in self._replicas]
        for url in removed:
            self.remove(url)
        for url in added:
            self.add(url)
        return added, removed


async def probe(replica: Replica, client: httpx.AsyncClient, timeout_s: float) -> bool:
    """Check ``GET {url}/ready`` once and record the result on the replica.

    Ready means: the connection works and the answer is neither 503 (loading or
    draining) nor another 5xx. A 404 counts as ready, so an OpenAI-compatible
    upstream without a ``/ready`` endpoint is judged by reachability alone.
    Probes only set readiness; the breaker is judged by real traffic, so a
    replica that answers probes but fails requests still gets opened.
    """
    try:
        response = await client.get(f"{replica.url}/ready", timeout=timeout_s)
    except httpx.HTTPError as exc:
        replica.set_ready(False, f"probe failed: {type(exc).__name__}")
        return False
    status = response.status_code
    if status == 503:
        replica.set_ready(False, "draining or loading (503)")
        return False
    if status >= 500:
        replica.set_ready(False, f"probe answered {status}")
        return False
    replica.set_ready(True)
    return True
