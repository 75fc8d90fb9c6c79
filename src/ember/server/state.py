"""ServerState: what the routes share — the engine (once loaded), flags, metrics.

Life of a server: *loading* (the model loads in a background thread; /ready
and /v1 answer 503 with Retry-After) → *warming up* (a few real generations
through the engine, so the first user pays no first-call costs) → *ready* →
*draining* after SIGTERM (new /v1 requests get 503; in-flight ones finish).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from ember.config import ServerConfig
from ember.engine.async_engine import AsyncEngine
from ember.engine.sampling import SamplingParams
from ember.server.admission import Admission
from ember.server.degrade import DegradationController
from ember.server.metrics import ServerMetrics

PRIORITY_NAMES = {0: "high", 1: "normal", 2: "low"}

log = logging.getLogger("ember.server")

# Prompts for warmup: short and long enough to touch the decode and prefill paths.
WARMUP_PROMPTS = (
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Say hello in three languages, briefly."}],
)


class ServerState:
    """Shared server state; every field is read by routes on the event loop."""

    def __init__(self, config: ServerConfig, engine_factory: Callable[[], AsyncEngine], model_name: str | None = None) -> None:
        self.config = config
        self._engine_factory = engine_factory
        self.engine: AsyncEngine | None = None
        self.model_name = model_name or config.served_model_name or "ember"
        self.metrics = ServerMetrics(self.model_name)
        self.ready = False
        self.load_error: str | None = None
        self.draining = False
        self.started_at = time.time()
        self.in_flight = 0
        self.load_seconds: float | None = None
        self.warmup_seconds: float | None = None
        self.degrade = DegradationController(
            slo_p99_s=config.slo_p99_s,
            window_s=config.slo_window_s,
            ttft_slo_s=config.slo_ttft_p99_s,
            min_samples=config.slo_min_samples,
            on_change=self._on_degrade_change,
        )
        self.admission = Admission(
            max_running=config.max_running,
            max_queue=config.max_queue,
            max_queued_tokens=config.max_queued_tokens,
            per_key_concurrency=config.per_key_concurrency,
            on_reject=lambda reason, priority: self.metrics.rejected.labels(self.model_name, reason, PRIORITY_NAMES.get(priority, "normal")).inc(),
            shed_low=self.degrade.should_shed,
        )
        self.metrics.degraded.labels(self.model_name).set(0)
        self._normal_chunk_tokens: int | None = None

    async def load(self) -> None:
        """Load the model off the event loop, warm it up, then flip ``ready``."""
        started = time.perf_counter()
        try:
            engine = await asyncio.to_thread(self._engine_factory)
        except Exception as exc:
            self.load_error = f"{type(exc).__name__}: {exc}"
            log.exception("model failed to load")
            return
        engine.start()
        self.engine = engine
        if self.config.served_model_name is None:
            self.model_name = engine.engine.model_name
            self.metrics.model = self.model_name
        self.load_seconds = time.perf_counter() - started
        self._bind_metrics()
        warm_started = time.perf_counter()
        await self.warmup()
        self.warmup_seconds = time.perf_counter() - warm_started
        self.ready = True
        self.metrics.ready.labels(self.model_name).set(1)
        log.info("ready: model %s loaded in %.2fs, warmed up in %.2fs", self.model_name, self.load_seconds, self.warmup_seconds)

    async def warmup(self) -> None:
        """Run a few short generations end to end (template, tokenizer, prefill, decode, detokenizer)."""
        assert self.engine is not None
        tok = self.engine.tokenizer
        for i in range(self.config.warmup_requests):
            prompt = tok.encode_chat(WARMUP_PROMPTS[i % len(WARMUP_PROMPTS)])
            params = SamplingParams(max_tokens=8, temperature=0.0 if i % 2 == 0 else 0.7, top_p=0.9, logprobs=1 if i == 1 else None)
            async for _ in self.engine.generate(f"warmup-{i}", prompt, params):
                pass
        self.engine.engine.kv.pool.reset_prefix_cache()  # users start from a clean cache

    def _bind_metrics(self) -> None:
        assert self.engine is not None
        core = self.engine.engine
        admission_waiting = lambda: 0 if self.admission is None else self.admission.num_waiting  # noqa: E731
        self.metrics.bind_gauges(
            running=lambda: core.scheduler.num_running,
            waiting=lambda: core.scheduler.num_waiting + admission_waiting(),
            kv_usage=core.kv_usage,
            kv_bytes=lambda: core.kv.total_bytes,
        )
        self.metrics.bind_engine(core)

    async def shutdown(self) -> None:
        if self.engine is None:
            return
        if self.engine.engine.sessions is not None and self.engine.is_running:
            # Hot conversations survive a restart when a session_dir is set.
            written = await self.engine.call(lambda core: core.sessions.persist_all())
            if written:
                log.info("persisted %d session(s) to %s", written, self.engine.engine.sessions.config.session_dir)
        await asyncio.to_thread(self.engine.stop)

    def _on_degrade_change(self, degraded: bool, reason: str) -> None:
        log.warning("degradation %s: %s", "ENGAGED" if degraded else "released", reason)
        self.metrics.degraded.labels(self.model_name).set(1 if degraded else 0)
        if self.engine is not None:
            asyncio.ensure_future(self._apply_chunk_size())

    async def _apply_chunk_size(self) -> None:
        """Smaller prefill chunks while degraded protect running streams' inter-token latency."""
        assert self.engine is not None
        scheduler = self.engine.engine.scheduler
        if self._normal_chunk_tokens is None:
            self._normal_chunk_tokens = scheduler.max_num_batched_tokens
        tokens = self.degrade.prefill_chunk_tokens(self._normal_chunk_tokens)

        def apply(core) -> None:
            core.scheduler.max_num_batched_tokens = tokens

        await self.engine.call(apply)

    async def watch_latency(self, period_s: float = 1.0) -> None:
        """Re-evaluate the degradation rule even when no request finishes."""
        while True:
            await asyncio.sleep(period_s)
            self.degrade.evaluate()

    def retry_after_s(self) -> float:
        """How long a client should wait while the server loads or drains."""
        if self.draining:
            return max(1.0, self.config.drain_timeout_s)
        return 2.0
