"""Prometheus metrics: the only place that names them (ARCHITECTURE.md, "Metric names").

Latencies are in seconds. Buckets cover both sub-second chat latencies and
multi-second generations so p50 and p99 stay readable across the range.
Labels are low-cardinality: model, tier, code, priority; never an id.
Each app owns its registry, so several servers can live in one process (tests).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ember import malloc_heap
from ember.engine.api import EngineSnapshot

LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    15.0,
    20.0,
    30.0,
    60.0,
)
GC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    """Every metric the server exports, on one registry."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)  # process_resident_memory_bytes and friends
        r.register(_NativeHeapCollector())  # what of that RSS is malloc's heap, in use or free but held
        m = ["model"]
        # Every latency counts from the request's arrival at the server, admission wait included.
        self.request_duration = Histogram(
            "llm_request_duration_seconds",
            "End-to-end request latency, from arrival (admission wait included).",
            m,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "llm_time_to_first_token_seconds",
            "Time to first token, from arrival (admission wait included).",
            [*m, "tier"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram("llm_inter_token_latency_seconds", "Time between streamed tokens.", m, buckets=ITL_BUCKETS, registry=r)
        self.queue = Histogram(
            "llm_request_queue_seconds",
            "Time from arrival to first scheduling: admission wait plus the engine's queue (also requests whose deadline passed in the queue).",
            m,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("llm_prompt_tokens", "Prompt tokens received.", m, registry=r)
        self.generation_tokens = Counter("llm_generation_tokens", "Tokens generated.", m, registry=r)
        # Speculative decoding (engine/speculation.py): accepted / draft is the acceptance rate.
        self.spec_draft_tokens = Counter("llm_spec_draft_tokens", "Tokens drafted and verified by speculative decoding.", m, registry=r)
        self.spec_accepted_tokens = Counter("llm_spec_accepted_tokens", "Drafted tokens the model kept.", m, registry=r)
        self.requests = Counter("llm_requests", "Requests finished, by finish reason.", [*m, "finish_reason"], registry=r)
        self.errors = Counter("llm_request_errors", "Requests answered with an error, by HTTP status.", [*m, "code"], registry=r)
        self.running = Gauge("llm_requests_running", "Requests in the engine's running set.", m, registry=r)
        self.waiting = Gauge("llm_requests_waiting", "Requests queued (engine and admission).", m, registry=r)
        self.kv_usage = Gauge("llm_kv_cache_usage_ratio", "Fraction of KV blocks referenced by requests or hot sessions.", m, registry=r)
        self.kv_bytes = Gauge("llm_kv_cache_bytes", "Bytes of the preallocated KV block pool.", m, registry=r)
        self.kv_capacity = Gauge(
            "llm_kv_cache_capacity_tokens", "Tokens the KV block pool holds (twice as many with a float16 cache).", m, registry=r
        )
        self.degraded = Gauge("llm_degraded", "1 while the degradation controller is engaged.", m, registry=r)
        self.rejected = Counter("llm_requests_rejected", "Requests refused by admission control.", [*m, "reason", "priority"], registry=r)
        self.max_tokens_clamped = Counter(
            "llm_max_tokens_clamped", "Requests whose max_tokens was lowered by limits or degradation.", m, registry=r
        )
        self.ready = Gauge("llm_ready", "1 when the model is loaded and warmed up.", m, registry=r)
        # Collections hold the GIL: the event loop and the engine thread stop for their duration.
        self.gc_pause = Histogram(
            "llm_gc_pause_seconds",
            "Duration of each garbage collection, by generation.",
            [*m, "generation"],
            buckets=GC_BUCKETS,
            registry=r,
        )

    def bind_gauges(
        self,
        running: Callable[[], float],
        waiting: Callable[[], float],
        kv_usage: Callable[[], float],
        kv_bytes: Callable[[], float],
        kv_capacity_tokens: Callable[[], float],
    ) -> None:
        """Read live engine state at scrape time instead of pushing it every step."""
        self.running.labels(self.model).set_function(running)
        self.waiting.labels(self.model).set_function(waiting)
        self.kv_usage.labels(self.model).set_function(kv_usage)
        self.kv_bytes.labels(self.model).set_function(kv_bytes)
        self.kv_capacity.labels(self.model).set_function(kv_capacity_tokens)

    def bind_engine(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        """Export counters the engine keeps itself (prefix cache, session tiers) from its latest snapshot."""
        self.registry.register(_EngineCollector(self.model, snapshot))

    def render(self) -> bytes:
        return generate_latest(self.registry)


SESSION_TIERS = ("hot", "warm", "disk")


class _NativeHeapCollector(Collector):
    """``process_native_heap_bytes{state="in_use"|"free"}`` at scrape time (glibc only; absent elsewhere)."""

    def collect(self) -> Iterator[Any]:
        heap = malloc_heap.read()
        if heap is None:
            return
        family = GaugeMetricFamily(
            "process_native_heap_bytes",
            "malloc's heap: bytes allocated (in_use, mmap-served blocks included) and free but still resident (free).",
            labels=["state"],
        )
        family.add_metric(["in_use"], heap.in_use_bytes)
        family.add_metric(["free"], heap.free_bytes)
        yield family


class _EngineCollector(Collector):
    """Reads the engine's own counters from its latest snapshot when Prometheus scrapes."""

    def __init__(self, model: str, snapshot: Callable[[], EngineSnapshot]) -> None:
        self.model = model
        self.snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        snap = self.snapshot()
        queries = CounterMetricFamily("llm_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", labels=["model"])
        queries.add_metric([self.model], snap.prefix_query_tokens)
        yield queries
        hits = CounterMetricFamily(
            "llm_prefix_cache_hits", "Prompt tokens served from cache, by the tier they came from.", labels=["model", "tier"]
        )
        for tier in SESSION_TIERS:
            hits.add_metric([self.model, tier], snap.prefix_hit_tokens.get(tier, 0))
        yield hits
        count = GaugeMetricFamily(
            "llm_sessions", "Conversations kept, by tier (disk: warm state spilled to disk).", labels=["model", "tier"]
        )
        size = GaugeMetricFamily("llm_session_bytes", "Bytes held by each session tier.", labels=["model", "tier"])
        events = CounterMetricFamily("llm_session_transitions", "Session tier transitions and file events.", labels=["model", "event"])
        for tier in SESSION_TIERS:
            count.add_metric([self.model, tier], snap.session_counts.get(tier, 0))
            size.add_metric([self.model, tier], snap.session_bytes.get(tier, 0))
        for event, n in sorted(snap.session_events.items()):
            events.add_metric([self.model, event], n)
        yield count
        yield size
        yield events
