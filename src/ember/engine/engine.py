"""LLMEngine: the synchronous core. Add requests, call ``step()``, read outputs.

One ``step()`` = deadlines checked, one scheduling decision, one batched
forward pass, sampled tokens appended, stop conditions applied, finished
requests' blocks released (they stay as prefix cache). Nothing here is
thread-safe: ``AsyncEngine`` calls it from its own thread only.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import ParamSpec, TypeVar

import torch

from ember.config import EngineConfig, SessionConfig
from ember.engine import compute_threads
from ember.engine.block_pool import Block
from ember.engine.constraints import Constraint, GrammarCompiler
from ember.engine.detokenizer import Detokenizer
from ember.engine.kv_cache import KVCacheManager
from ember.engine.request import FinishReason, Priority, Request, RequestOutput, RequestStatus, TokenLogprob
from ember.engine.runner import ModelRunner
from ember.engine.sampling import SamplingParams
from ember.engine.scheduler import Scheduler
from ember.engine.sessions import SessionManager
from ember.engine.speculation import RequestSpeculation, share_draft_rows
from ember.engine.stats import EngineCounters, EngineInfo, EngineSnapshot
from ember.errors import ContextLengthExceededError, EmberError, InvalidSamplingParamsError
from ember.kernels import cpu as cpu_kernels
from ember.model.llama import LlamaModel
from ember.model.loader import LoadedModel, load_model
from ember.model.tokenizer import Tokenizer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# EngineConfig.kv_cache_dtype; "auto" is the model's dtype.
_KV_CACHE_DTYPES = {"auto": None, "float16": torch.float16}
P = ParamSpec("P")
R = TypeVar("R")


def _held_weakly(method: Callable[P, R]) -> Callable[P, R]:
    """``method`` as a callback that does not keep its object alive.

    Invariant: no part the engine owns holds a strong reference back to the
    engine or to a part that owns it (the KV manager's pressure callback into
    the sessions, which hold the KV manager). A cycle would keep the KV pool
    (hundreds of MB) alive after the last user reference is dropped until
    Python's cyclic collector happens to run, and tensor memory never triggers
    it: a test suite or a notebook that builds engines one after another ran
    out of memory that way.
    """
    ref, name = weakref.WeakMethod(method), method.__qualname__  # never `method` itself: it holds the object

    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        bound = ref()
        if bound is None:
            raise ReferenceError(f"{name}: its object was dropped")
        return bound(*args, **kwargs)

    return call


class LLMEngine:
    """Loads a model and runs requests to completion with continuous batching.

    The thread that constructs the engine becomes its compute thread
    (``compute_threads``): build it on the thread that will call ``step``.
    """

    def __init__(
        self,
        model: str | None = None,
        config: EngineConfig | None = None,
        *,
        loaded: LoadedModel | None = None,
        sessions: SessionConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config = config or EngineConfig()
        kernels = cpu_kernels.load() if torch.device(config.device).type == "cpu" else None
        compute_threads.claim_for_engine(config.threads, [kernels] if kernels is not None else [])
        if config.dtype not in _DTYPES:
            raise InvalidSamplingParamsError(f"dtype must be one of {sorted(_DTYPES)}, got {config.dtype!r}", "dtype")
        if config.kv_cache_dtype not in _KV_CACHE_DTYPES:
            raise InvalidSamplingParamsError(
                f"kv_cache_dtype must be one of {sorted(_KV_CACHE_DTYPES)}, got {config.kv_cache_dtype!r}", "kv_cache_dtype"
            )
        self.clock = clock
        loaded = loaded or load_model(model)
        self.model_name = loaded.name
        self.model_path = loaded.path
        self.fingerprint = loaded.fingerprint
        self.model_config = loaded.config
        self.generation_defaults = dict(loaded.generation_defaults)
        self.tokenizer = Tokenizer(loaded.tokenizer)
        self.dtype = _DTYPES[config.dtype]
        self.device = torch.device(config.device)
        self.max_model_len = min(config.max_model_len or loaded.config.max_position_embeddings, loaded.config.max_position_embeddings)
        self.model = LlamaModel(
            loaded.config,
            loaded.weights,
            self.dtype,
            config.quantization,
            self.device,
            self.max_model_len,
            batch_invariant=config.batch_invariant,
        )
        self.kv = KVCacheManager(loaded.config, config, _KV_CACHE_DTYPES[config.kv_cache_dtype] or self.dtype, self.device)
        self.scheduler = Scheduler(config, self.kv, _held_weakly(self._lookup_prefix))
        self.runner = ModelRunner(self.model, self.kv, self.device)
        self.detokenizer = Detokenizer(self.tokenizer.hf)
        self.sessions: SessionManager | None = None
        if sessions is not None and sessions.enabled and config.enable_prefix_caching:
            # The callbacks hold the tokenizer and scheduler, not the engine (see _held_weakly).
            tokenizer, scheduler = self.tokenizer, self.scheduler
            decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
            self.sessions = SessionManager(sessions, self.kv, self.fingerprint, decode, clock, busy=lambda: bool(scheduler.running))
            self.kv.on_pressure = _held_weakly(self.sessions.relieve_pressure)
        # Requests waiting for their conversation's KV to be read from disk (not yet schedulable).
        self.loading: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}
        # Requests in flight when a step raised. That step's KV may be half written, and a
        # request admitted in it may have found another's blocks before they were retracted:
        # none of them may run on. ``step`` refuses until they are all aborted.
        self._failed_step_requests: set[str] = set()
        self.stats = EngineCounters()
        self.eos_token_ids = self.tokenizer.eos_token_ids
        self._grammar: GrammarCompiler | None = None
        # Drafts are verified exactly only where a row's logits do not depend on its neighbours.
        self.num_speculative_tokens = max(0, config.num_speculative_tokens) if self.model.batch_invariant else 0

    @property
    def grammar(self) -> GrammarCompiler:
        """Compiles response formats and tool grammars for this model's vocabulary.

        Built on first use (~0.3 s); raises ``GrammarUnavailableError`` without
        the ``ember[structured]`` extra. ``compile`` is safe from any thread.
        """
        if self._grammar is None:
            self._grammar = GrammarCompiler(self.tokenizer.hf, self.model_config.vocab_size, self.eos_token_ids)
        return self._grammar

    # -- requests --------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        priority: int = Priority.NORMAL,
        deadline: float | None = None,
        session_id: str | None = None,
        arrival_time: float | None = None,
        constraint: Constraint | None = None,
        prediction: Sequence[int] | None = None,
    ) -> Request:
        """Queue a request. Raises ``ContextLengthExceededError`` or ``InvalidSamplingParamsError``.

        ``constraint``: a grammar its output must follow. ``prediction``: token
        ids the answer is expected to repeat (OpenAI's Predicted Outputs), the
        first place drafts are taken from; it never changes the answer.
        """
        if request_id in self.requests:
            raise EmberError(f"request id {request_id!r} is already running")
        prompt = list(prompt_token_ids)
        self.check_prompt(prompt, params)
        request = Request(
            request_id,
            prompt,
            params,
            self.clock() if arrival_time is None else arrival_time,
            priority=priority,
            deadline=deadline,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            session_id=session_id,
            constraint=constraint,
        )
        request.detok = self.detokenizer.start(len(prompt))
        c = self.config
        # A grammar's masks are per position: a constrained request is not drafted (its prediction goes unused).
        draft_tokens = self.num_speculative_tokens if constraint is None else 0
        if draft_tokens > 0 or prediction:
            request.speculation = RequestSpeculation(draft_tokens, c.prompt_lookup_min, c.prompt_lookup_max, prediction)
        self.requests[request_id] = request
        if self.sessions is not None and self.sessions.restorer.begin_restore(request):
            self.loading[request_id] = request  # scheduled once the storage thread has copied its warm KV back
        else:
            self.scheduler.add(request)
        return request

    def _lookup_prefix(self, request: Request) -> list[Block]:
        """The request's cached prefix at admission: blocks in the pool, then warm blocks restored
        into it; sets ``request.cache_tier`` and ``request.cached_tokens_by_tier``."""
        hits = self.kv.find_cached_prefix(request)
        bs = self.kv.block_size
        by_tier = {"hot": len(hits) * bs} if hits else {}
        pins = self.sessions.restorer.take_pins(request.request_id) if self.sessions is not None else None
        if pins is not None:
            # The restored blocks follow the pooled prefix the request had when it arrived.
            restored = max(0, min(len(hits), pins.start + len(pins.blocks)) - pins.start)
            if restored:
                by_tier = {"hot": min(len(hits), pins.start) * bs, pins.tier: restored * bs}
                by_tier = {tier: n for tier, n in by_tier.items() if n}
            # The admission references the hits right after this lookup; nothing allocates in between.
            self.kv.pool.release(pins.blocks)
        request.cached_tokens_by_tier = by_tier
        request.cache_tier = max(by_tier, key=by_tier.__getitem__) if by_tier else "cold"
        return hits

    def check_prompt(self, prompt: list[int], params: SamplingParams) -> None:
        """Validate a prompt against the context and the pool; raise a named error."""
        if not prompt:
            raise InvalidSamplingParamsError("The prompt is empty; send at least one token.", "prompt")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise InvalidSamplingParamsError(f"Prompt token ids must be in [0, {vocab}).", "prompt")
        if any(not 0 <= t < vocab for t in params.logit_bias):
            raise InvalidSamplingParamsError(f"logit_bias token ids must be in [0, {vocab}).", "logit_bias")
        wanted = params.max_tokens or 1
        if len(prompt) + max(wanted, params.min_tokens) > self.max_model_len:  # noqa: SIM102 (two reasons, one error)
            if len(prompt) >= self.max_model_len or params.max_tokens is not None:
                raise ContextLengthExceededError(len(prompt), wanted, self.max_model_len)
        capacity = self.kv.capacity_tokens
        if len(prompt) + 1 > capacity:
            raise ContextLengthExceededError(len(prompt), wanted, capacity)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output, if it was known."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        return self._finish(request, reason, None, "")

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def idle_tick(self) -> None:
        """Housekeeping while no request runs (session TTLs)."""
        if self.sessions is not None:
            self.sessions.tick()

    # -- the step ------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine iteration; returns an output for every request that changed.

        If it raises, abort every request in flight before stepping again (``AsyncEngine``
        fails them all); until then it raises ``RuntimeError``.
        """
        if self._failed_step_requests:
            self._failed_step_requests &= self.requests.keys()
            if self._failed_step_requests:
                names = ", ".join(sorted(self._failed_step_requests))
                raise RuntimeError(f"a step failed; abort the requests that were in flight before stepping again: {names}")
        outputs: list[RequestOutput] = []
        compute_threads.keep_engine_count()
        now = self.clock()
        if self.sessions is not None:
            self.sessions.tick()
            for request_id in self.sessions.restorer.take_ready():
                if (waiting := self.loading.pop(request_id, None)) is not None:
                    self.scheduler.add(waiting)
                elif (pins := self.sessions.restorer.take_pins(request_id)) is not None:
                    self.kv.pool.release(pins.blocks)  # its request ended while the copy ran
        for request in [r for r in self.requests.values() if r.deadline is not None and now >= r.deadline]:
            outputs.append(self._finish(request, FinishReason.TIMEOUT, "timeout", ""))
        self._propose_drafts()
        sched = self.scheduler.schedule()
        self.stats.preemptions += len(sched.preempted)
        if sched.is_empty:
            if self.loading and self.sessions is not None:
                self.sessions.storage.wait(0.002)  # only restores in flight: wait for one instead of spinning
            return outputs
        started = time.perf_counter()
        scheduled_at = self.clock()  # "scheduled" is when its first step began, not when it ended
        try:
            result = self.runner.execute(sched)
        except BaseException:
            self.kv.retract_step()  # blocks published for this step were never written
            self._failed_step_requests = set(self.requests)
            raise
        self.kv.end_step()
        self.stats.busy_seconds += time.perf_counter() - started
        self.stats.steps += 1
        now = self.clock()
        self.stats.prefill_tokens_computed += sum(item.num_new_tokens for item in sched.prefills)
        for item in (*sched.decodes, *sched.prefills):
            request = item.request
            if request.times.scheduled is None:
                request.times.scheduled = scheduled_at
            # Its full blocks entered the prefix cache when it was scheduled (publish_scheduled).
            request.num_computed_tokens += item.num_new_tokens
        for request_id, token in result.sampled.items():
            request = self.requests[request_id]
            outputs.append(self._append_token(request, token, result.logprobs.get(request_id), now))
        for request_id, logits in result.verify.items():
            outputs.extend(self._accept_draft(self.requests[request_id], logits, now))
        return outputs

    def _propose_drafts(self) -> None:
        """Give each speculating decode its draft for this step (engine/speculation.py)."""
        if self.num_speculative_tokens <= 0:
            return
        decodes = [r for r in self.scheduler.running if r.num_tokens - r.num_computed_tokens == 1]
        for request in self.scheduler.running:
            request.draft = None
        drafting = [(r, r.speculation) for r in decodes if r.speculation is not None]
        # Each step emits up to 1 + len(draft) tokens: never past max_tokens or the context.
        wanted = [min(spec.wanted, r.max_tokens - r.num_output_tokens - 1, self.max_model_len - r.num_tokens - 1) for r, spec in drafting]
        for (request, spec), limit in zip(drafting, share_draft_rows(wanted, len(decodes)), strict=True):
            request.draft = spec.propose(request.token_ids, limit)

    def _accept_draft(self, request: Request, logits: torch.Tensor, now: float) -> list[RequestOutput]:
        """Emit the tokens a verify pass decided: row ``i``'s draw, while the draws match the draft.

        Invariant (engine/speculation.py): row ``i`` holds the logits a plain
        decode would have after the draft's first ``i`` tokens, and each row is
        drawn with the request's own sampler state (penalties see the tokens
        emitted so far; its generator advances once per emitted token). So the
        emitted tokens are the ones plain decoding emits, token for token.
        """
        draft, spec = request.draft, request.speculation
        assert draft is not None and spec is not None
        outputs: list[RequestOutput] = []
        accepted = 0
        for i in range(len(draft.tokens) + 1):
            tokens, logprobs = self.runner.sampler(logits[i : i + 1], [request])
            out = self._append_token(request, tokens[0], logprobs[0], now)
            outputs.append(out)
            if out.finished or i == len(draft.tokens) or tokens[0] != draft.tokens[i]:
                break
            accepted += 1
            request.num_computed_tokens += 1  # the KV the pass wrote for draft token i is that of the token now there
            self.kv.register_computed_blocks(request)  # before a later token can finish the request, as in a plain step
        spec.record(draft, accepted)
        request.draft = None
        self.stats.draft_tokens += len(draft.tokens)
        self.stats.accepted_draft_tokens += accepted
        # The counters as they stand after this step, on the step's last output.
        outputs[-1] = replace(outputs[-1], speculation=spec.report())
        return outputs

    def _append_token(self, request: Request, token: int, logprob: TokenLogprob | None, now: float) -> RequestOutput:
        request.token_ids.append(token)
        self.stats.generation_tokens += 1
        if logprob is not None:
            request.logprobs.append(logprob)
        if request.times.first_token is None:
            request.times.first_token = now
        request.times.last_token = now
        p = request.params
        reason: FinishReason | None = None
        stop_reason: str | int | None = None
        if token in request.stop_token_ids and request.num_output_tokens >= p.min_tokens:
            reason = FinishReason.STOP
            stop_reason = None if token in self.eos_token_ids and not p.ignore_eos else token
        elif request.constraint is not None and _grammar_done(request.constraint, token):
            reason = FinishReason.STOP
        elif request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
            reason = FinishReason.LENGTH
        stop_strings = p.stop if request.num_output_tokens >= p.min_tokens else []
        delta, matched = self.detokenizer.step(
            request.detok, request.token_ids, stop_strings, p.include_stop_str_in_output, p.skip_special_tokens, reason is not None
        )
        if matched is not None:
            reason, stop_reason = FinishReason.STOP_STRING, matched
        if reason is not None:
            return self._finish(request, reason, stop_reason, delta, new_token=token)
        return self._output(request, delta, [token], None)

    def _finish(
        self, request: Request, reason: FinishReason, stop_reason: str | int | None, delta: str, new_token: int | None = None
    ) -> RequestOutput:
        if reason in (FinishReason.ABORT, FinishReason.TIMEOUT) and request.detok is not None:
            tail, _ = self.detokenizer.step(request.detok, request.token_ids, [], False, request.params.skip_special_tokens, True)
            delta += tail
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        request.times.finished = self.clock()
        if self.sessions is not None and request.session_id is not None:
            self.sessions.on_request_finished(request, self.kv.blocks_of(request))
        self.scheduler.remove(request)
        self.loading.pop(request.request_id, None)
        if self.sessions is not None and (pins := self.sessions.restorer.take_pins(request.request_id)) is not None:
            self.kv.pool.release(pins.blocks)  # restored for an admission that never came
        self.requests.pop(request.request_id, None)
        self.stats.finished += 1
        if reason == FinishReason.ABORT:
            self.stats.aborted += 1
        elif reason == FinishReason.TIMEOUT:
            self.stats.timed_out += 1
        return self._output(request, delta, [] if new_token is None else [new_token], reason)

    @staticmethod
    def _output(request: Request, delta: str, new_tokens: list[int], reason: FinishReason | None) -> RequestOutput:
        new_logprobs = request.logprobs[-len(new_tokens) :] if new_tokens and request.logprobs else []
        return RequestOutput(
            request_id=request.request_id,
            text_delta=delta,
            new_token_ids=new_tokens,
            finished=reason is not None,
            finish_reason=reason,
            stop_reason=request.stop_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens,
            cache_tier=request.cache_tier,
            logprobs=new_logprobs,
            times=request.times,
            speculation=None if request.speculation is None else request.speculation.report(),
        )

    # -- introspection ---------------------------------------------------------------

    def kv_usage(self) -> float:
        return self.kv.pool.usage()

    def info(self) -> EngineInfo:
        c = self.config
        return EngineInfo(
            model_name=self.model_name,
            fingerprint=self.fingerprint,
            max_model_len=self.max_model_len,
            block_size=self.kv.block_size,
            kv_cache_bytes=self.kv.total_bytes,
            kv_capacity_tokens=self.kv.capacity_tokens,
            dtype=c.dtype,
            quantization=c.quantization,
            threads=torch.get_num_threads(),
            sessions_enabled=self.sessions is not None,
            session_dir=self.sessions.config.session_dir if self.sessions is not None else None,
            vocab_size=self.model_config.vocab_size,
            generation_defaults=dict(self.generation_defaults),
        )

    def snapshot(self, with_sessions: bool = True) -> EngineSnapshot:
        """The engine's state now, as a frozen object other threads may read (engine thread only)."""
        kv, sessions = self.kv, self.sessions
        session_stats: dict[str, dict[str, int]] = {}
        if with_sessions and sessions is not None:
            session_stats = {
                "session_counts": sessions.policy.counts(),
                "session_bytes": sessions.tier_bytes(),
                "session_events": dict(sessions.events),
            }
        return EngineSnapshot(
            at=self.clock(),
            running=self.scheduler.num_running,
            waiting=self.scheduler.num_waiting,
            kv_usage=kv.pool.usage(),
            max_num_batched_tokens=self.scheduler.max_num_batched_tokens,
            counters=replace(self.stats),
            prefix_query_tokens=kv.prefix_queries_tokens,
            prefix_hit_tokens=dict(kv.prefix_hit_tokens),
            **session_stats,
        )


def _grammar_done(constraint: Constraint, token: int) -> bool:
    """Advance a request's grammar past ``token``; True once the output is complete.

    A token the grammar refuses cannot be sampled from its own mask; should one
    arrive anyway the request stops rather than run on unconstrained.
    """
    return not constraint.accept(token) or constraint.is_terminated()
