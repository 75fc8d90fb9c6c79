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
from collections.abc import Callable

from ember.config import ServerConfig
from ember.engine.api import AsyncEngine, SamplingParams, grammar_available
from ember.server.admission import Admission
from ember.server.defaults import GenerationDefaults, resolve_defaults
from ember.server.degrade import DegradationController
from ember.server.metrics import ServerMetrics
from ember.server.pauses import GCPauses, freeze_heap, preload_lazy_imports

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
        # Tasks started from callbacks: the loop keeps only weak references to tasks.
        self._background: set[asyncio.Future[None]] = set()
        self.load_seconds: float | None = None
        self.warmup_seconds: float | None = None
        self.degrade = DegradationController(
            queue_slo_s=config.slo_queue_p99_s,
            itl_slo_s=config.slo_itl_p99_s,
            ttft_slo_s=config.slo_ttft_p99_s,
            window_s=config.slo_window_s,
            eval_window_s=config.slo_eval_window_s,
            min_samples=config.slo_min_samples,
            on_change=self._on_degrade_change,
        )
        self.admission = Admission(
            max_running=config.max_running,
            max_queue=config.max_queue,
            max_queued_tokens=config.max_queued_tokens,
            per_key_concurrency=config.per_key_concurrency,
            on_reject=lambda reason, priority: self.metrics.rejected.labels(
                self.model_name, reason, PRIORITY_NAMES.get(priority, "normal")
            ).inc(),
            shed_low=self.degrade.should_shed,
            on_depth=self.degrade.queue_depth,
        )
        self.metrics.degraded.labels(self.model_name).set(0)
        self.gc_pauses: GCPauses | None = None
        self._normal_chunk_tokens: int | None = None
        # What requests get for the fields they leave out; the model's own values join once it loaded.
        self.defaults = self._resolve_defaults({})

    def _resolve_defaults(self, model_defaults: dict[str, float]) -> GenerationDefaults:
        c = self.config
        return resolve_defaults(c.profile, model_defaults, c.default_temperature, c.default_top_p)

    async def load(self) -> None:
        """Load the model off the event loop, warm it up, then flip ``ready``."""
        started = time.perf_counter()
        engine = self._engine_factory()
        try:
            await engine.start_async()  # the engine thread builds the model
        except Exception as exc:
            self.load_error = f"{type(exc).__name__}: {exc}"
            log.exception("model failed to load")
            return
        self.engine = engine
        self._normal_chunk_tokens = engine.snapshot.max_num_batched_tokens
        self.defaults = self._resolve_defaults(engine.info.generation_defaults)
        if self.config.served_model_name is None:
            self.model_name = engine.info.model_name
            self.metrics.model = self.model_name
        self.load_seconds = time.perf_counter() - started
        self._bind_metrics()
        warm_started = time.perf_counter()
        if grammar_available():
            # The grammar compiler's view of the vocabulary takes ~0.3 s: not on a user's request.
            await asyncio.to_thread(engine.warm_grammar)
        await self.warmup()
        preload_lazy_imports()
        freeze_heap()  # the model's heap out of every later collection (server/pauses.py)
        # From here on: pauses while serving, not those of loading.
        self.gc_pauses = GCPauses(lambda generation, s: self.metrics.gc_pause.labels(self.model_name, str(generation)).observe(s))
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
        await self.engine.reset_prefix_cache()  # users start from a clean cache

    def _bind_metrics(self) -> None:
        engine = self.engine
        assert engine is not None
        self.metrics.bind_gauges(
            running=lambda: engine.snapshot.running,
            waiting=lambda: engine.snapshot.waiting + self.admission.num_waiting,
            kv_usage=lambda: engine.snapshot.kv_usage,
            kv_bytes=lambda: engine.info.kv_cache_bytes,
            kv_capacity_tokens=lambda: engine.info.kv_capacity_tokens,
        )
        self.metrics.bind_engine(lambda: engine.snapshot)

    async def shutdown(self) -> None:
        if self.gc_pauses is not None:
            self.gc_pauses.close()
        if self.engine is None:
            return
        info = self.engine.info
        if info.sessions_enabled and self.engine.is_running:
            # Hot conversations survive a restart when a session_dir is set.
            written = await self.engine.persist_sessions()
            if written:
                log.info("persisted %d session(s) to %s", written, info.session_dir)
        await asyncio.to_thread(self.engine.stop)

    def _on_degrade_change(self, degraded: bool, reason: str) -> None:
        log.warning("degradation %s: %s", "ENGAGED" if degraded else "released", reason)
        self.metrics.degraded.labels(self.model_name).set(1 if degraded else 0)
        if self.engine is not None:
            task = asyncio.ensure_future(self._apply_chunk_size())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _apply_chunk_size(self) -> None:
        """Smaller prefill chunks while degraded protect running streams' inter-token latency."""
        assert self.engine is not None and self._normal_chunk_tokens is not None
        await self.engine.set_prefill_chunk_tokens(self.degrade.prefill_chunk_tokens(self._normal_chunk_tokens))

    async def watch_latency(self) -> None:
        """Evaluate the degradation rule periodically: every second, or a tenth
        of the evaluation window when that is shorter (short windows in tests)."""
        period_s = min(1.0, self.degrade.eval_window_s / 10)
        while True:
            await asyncio.sleep(period_s)
            self.degrade.evaluate()

    def retry_after_s(self) -> float:
        """How long a client should wait while the server loads or drains."""
        if self.draining:
            return max(1.0, self.config.drain_timeout_s)
        return 2.0
