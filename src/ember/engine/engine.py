"""LLMEngine: the synchronous core. Add requests, call ``step()``, read outputs.

One ``step()`` = deadlines checked, one scheduling decision, one batched
forward pass, sampled tokens appended, stop conditions applied, finished
requests' blocks released (they stay as prefix cache). Nothing here is
thread-safe: ``AsyncEngine`` calls it from its own thread only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ember.config import EngineConfig, SessionConfig
from ember.engine.detokenizer import Detokenizer
from ember.engine.kv_cache import KVCacheManager
from ember.engine.request import FinishReason, Priority, Request, RequestOutput, RequestStatus
from ember.engine.runner import ModelRunner
from ember.engine.sampling import SamplingParams
from ember.engine.scheduler import Scheduler
from ember.engine.sessions import SessionManager
from ember.errors import ContextLengthExceededError, EmberError, InvalidSamplingParamsError
from ember.model.llama import LlamaModel
from ember.model.loader import LoadedModel, load_model
from ember.model.tokenizer import Tokenizer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class EngineStats:
    """Monotonic counters since start (the server exports them as metrics)."""

    steps: int = 0
    # Tokens run through the model as prompt chunks (prefix hits excluded).
    prefill_tokens_computed: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    finished: int = 0
    aborted: int = 0
    timed_out: int = 0
    busy_seconds: float = 0.0


class LLMEngine:
    """Loads a model and runs requests to completion with continuous batching."""

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
        if config.threads > 0:
            torch.set_num_threads(config.threads)
        if config.dtype not in _DTYPES:
            raise InvalidSamplingParamsError(f"dtype must be one of {sorted(_DTYPES)}, got {config.dtype!r}", "dtype")
        self.clock = clock
        loaded = loaded or load_model(model)
        self.model_name = loaded.name
        self.model_path = loaded.path
        self.fingerprint = loaded.fingerprint
        self.model_config = loaded.config
        self.tokenizer = Tokenizer(loaded.tokenizer)
        self.dtype = _DTYPES[config.dtype]
        self.device = torch.device(config.device)
        self.max_model_len = min(config.max_model_len or loaded.config.max_position_embeddings, loaded.config.max_position_embeddings)
        self.model = LlamaModel(loaded.config, loaded.weights, self.dtype, config.quantization, self.device, self.max_model_len)
        self.kv = KVCacheManager(loaded.config, config, self.dtype, self.device)
        self.scheduler = Scheduler(config, self.kv)
        self.runner = ModelRunner(self.model, self.kv, self.device)
        self.detokenizer = Detokenizer(self.tokenizer.hf)
        self.sessions: SessionManager | None = None
        if sessions is not None and sessions.enabled and config.enable_prefix_caching:
            decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
            self.sessions = SessionManager(sessions, self.kv, self.fingerprint, decode, clock)
            self.kv.tiers = self.sessions
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self.eos_token_ids = self.tokenizer.eos_token_ids

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
    ) -> Request:
        """Queue a request. Raises ``ContextLengthExceededError`` or ``InvalidSamplingParamsError``."""
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
        )
        request.detok = self.detokenizer.start(len(prompt))
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request

    def check_prompt(self, prompt: list[int], params: SamplingParams) -> None:
        """Validate a prompt against the context and the pool; raise a named error."""
        if not prompt:
            raise InvalidSamplingParamsError("The prompt is empty; send at least one token.", "prompt")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise InvalidSamplingParamsError(f"Prompt token ids must be in [0, {vocab}).", "prompt")
        wanted = params.max_tokens or 1
        if len(prompt) + max(wanted, params.min_tokens) > self.max_model_len:
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
        """One engine iteration; returns an output for every request that changed."""
        outputs: list[RequestOutput] = []
        now = self.clock()
        if self.sessions is not None:
            self.sessions.tick()
        for request in [r for r in self.requests.values() if r.deadline is not None and now >= r.deadline]:
            outputs.append(self._finish(request, FinishReason.TIMEOUT, "timeout", ""))
        sched = self.scheduler.schedule()
        self.stats.preemptions += len(sched.preempted)
        if sched.is_empty:
            return outputs
        started = time.perf_counter()
        result = self.runner.execute(sched)
        self.stats.busy_seconds += time.perf_counter() - started
        self.stats.steps += 1
        now = self.clock()
        self.stats.prefill_tokens_computed += sum(item.num_new_tokens for item in sched.prefills)
        for item in (*sched.decodes, *sched.prefills):
            request = item.request
            if request.times.scheduled is None:
                request.times.scheduled = now
            request.num_computed_tokens += item.num_new_tokens
            self.kv.register_computed_blocks(request)
        for request_id, token in result.sampled.items():
            request = self.requests[request_id]
            outputs.append(self._append_token(request, token, result.logprobs.get(request_id), now))
        return outputs

    def _append_token(self, request: Request, token: int, logprob, now: float) -> RequestOutput:
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

    def _finish(self, request: Request, reason: FinishReason, stop_reason: str | int | None, delta: str, new_token: int | None = None) -> RequestOutput:
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
        )

    # -- introspection ---------------------------------------------------------------

    def kv_usage(self) -> float:
        return self.kv.pool.usage()
