"""The router's Prometheus metrics: the only place their names are written.

Every name starts with ``ember_router_``. Labels stay low-cardinality: the
upstream URL, an HTTP status code, a route or an error kind; never a request
or session id. Each router app has its own registry, so several routers (or
tests) in one process do not collide. Breaker state, readiness and in-flight
counts are read from the replica set at scrape time, so they cannot go stale;
a removed upstream's series are dropped with it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ember.router.breaker import BreakerState
from ember.router.replicas import ReplicaSet

# Time to first byte through the router is dominated by the replica's prefill;
# the low buckets resolve the router's own sub-millisecond overhead.
TTFB_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

BREAKER_STATE_VALUE = {BreakerState.CLOSED: 0.0, BreakerState.HALF_OPEN: 1.0, BreakerState.OPEN: 2.0}


class RouterMetrics:
    """Counters and histograms of one router, plus the replica state collector."""

    def __init__(self, replicas: ReplicaSet, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self._requests = Counter(
            "ember_router_requests",
            "Client requests answered, by route and HTTP status.",
            ["route", "code"],
            registry=r,
        )
        self._upstream_requests = Counter(
            "ember_router_upstream_requests",
            "Attempts that got an HTTP answer from an upstream, by status.",
            ["upstream", "code"],
            registry=r,
        )
        self._upstream_errors = Counter(
            "ember_router_upstream_errors",
            "Upstream failures by kind: connect, timeout, protocol, status_5xx, status_429, status_503, stream_broken, stream_stalled.",
            ["upstream", "kind"],
            registry=r,
        )
        self._ttfb = Histogram(
            "ember_router_upstream_time_to_first_byte_seconds",
            "From sending a request upstream to its first response body byte.",
            ["upstream"],
            buckets=TTFB_BUCKETS,
            registry=r,
        )
        self._duration = Histogram(
            "ember_router_upstream_request_duration_seconds",
            "From sending a request upstream to the end of its response.",
            ["upstream"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self._retries = Counter("ember_router_retries", "Requests sent to another replica, by the reason.", ["reason"], registry=r)
        self._affinity = Counter(
            "ember_router_session_affinity",
            "Session requests served by their home replica (hit) or elsewhere (miss).",
            ["result"],
            registry=r,
        )
        self._probe_failures = Counter("ember_router_probe_failures", "Failed /ready probes.", ["upstream"], registry=r)
        self._config_reloads = Counter("ember_router_config_reloads", "Upstreams file reloads, by result.", ["result"], registry=r)
        # Metrics whose first label is the upstream URL.
        self._upstream_metrics = (
            self._upstream_requests,
            self._upstream_errors,
            self._ttfb,
            self._duration,
            self._probe_failures,
        )
        # Label children cached by (metric, label values): skips labels()'s lock
        # and lookup on the hot path, and remembers what to drop with an upstream.
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}
        r.register(_ReplicaStateCollector(replicas))

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (metric, labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def request_done(self, route: str, status: int) -> None:
        self._child(self._requests, route, str(status)).inc()

    def upstream_answered(self, url: str, status: int) -> None:
        self._child(self._upstream_requests, url, str(status)).inc()

    def upstream_error(self, url: str, kind: str) -> None:
        self._child(self._upstream_errors, url, kind).inc()

    def first_byte(self, url: str, seconds: float) -> None:
        self._child(self._ttfb, url).observe(seconds)

    def upstream_finished(self, url: str, seconds: float) -> None:
        self._child(self._duration, url).observe(seconds)

    def retry(self, reason: str) -> None:
        self._child(self._retries, reason).inc()

    def affinity(self, hit: bool) -> None:
        self._child(self._affinity, "hit" if hit else "miss").inc()

    def probe_failed(self, url: str) -> None:
        self._child(self._probe_failures, url).inc()

    def config_reloaded(self, ok: bool) -> None:
        self._child(self._config_reloads, "ok" if ok else "error").inc()

    def forget_upstream(self, url: str) -> None:
        """Drop every series labelled with a removed upstream (keeps cardinality bounded)."""
        for key in [k for k in self._children if k[0] in self._upstream_metrics and k[1][0] == url]:
            metric, labels = key
            metric.remove(*labels)
            del self._children[key]


class _ReplicaStateCollector(Collector):
    """Gauges read from the live replica set on every scrape."""

    def __init__(self, replicas: ReplicaSet) -> None:
        self._replicas = replicas

    def describe(self) -> list[Any]:
        # Declaring nothing keeps registration from calling collect() early.
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        breaker = GaugeMetricFamily(
            "ember_router_upstream_breaker_state",
            "Circuit breaker state: 0 closed, 1 half-open, 2 open.",
            labels=["upstream"],
        )
        ready = GaugeMetricFamily("ember_router_upstream_ready", "1 when the last probe found the upstream ready.", labels=["upstream"])
        in_flight = GaugeMetricFamily(
            "ember_router_upstream_in_flight",
            "Requests the router has outstanding on the upstream.",
            labels=["upstream"],
        )
        for replica in self._replicas:
            breaker.add_metric([replica.url], BREAKER_STATE_VALUE[replica.breaker.state])
            ready.add_metric([replica.url], 1.0 if replica.ready else 0.0)
            in_flight.add_metric([replica.url], float(replica.in_flight))
        yield breaker
        yield ready
        yield in_flight
