"""From a validated request to engine outputs: prompt, limits, deadline, metrics.

Routes call ``prepare_*`` (which raises ``APIError`` for any client mistake,
before a byte of the reply is sent) and then iterate ``run``. The same code
serves chat and completions, streaming or not, over HTTP or gRPC: what it
needs from the request besides the body is a ``Caller`` (headers or metadata,
the request id, the API key's namespace), not a Starlette request.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from starlette.requests import Request as HTTPRequest

from ember.config import MAX_TOKENS_PRESETS
from ember.engine.request import RequestOutput
from ember.engine.sampling import SamplingParams
from ember.errors import ContextLengthExceededError, EmberError
from ember.server.errors import APIError, bad_request, from_engine_error, unavailable
from ember.server.protocol import ChatCompletionRequest, CompletionRequest, _GenerationFields, parse_priority
from ember.server.state import ServerState


@dataclass
class Caller:
    """What generation needs to know about a request besides its body, whatever the wire.

    ``headers`` are lower-case names (HTTP headers or gRPC metadata):
    ``x-request-timeout``, ``x-session-id`` and ``x-priority`` are read.
    ``on_done`` callbacks run once when the exchange ends, however it ends
    (e.g. giving the admission slot back); whoever made the Caller runs them.
    """

    request_id: str
    headers: Mapping[str, str]
    key_namespace: str | None = None
    on_done: list[Callable[[], None]] = field(default_factory=list)

    @classmethod
    def from_http(cls, http: HTTPRequest) -> Caller:
        """The Caller of an HTTP request; ``on_done`` is the list the middleware runs."""
        scope_state = http.scope["state"]
        return cls(scope_state["request_id"], http.headers, scope_state.get("api_key_namespace"), scope_state.setdefault("on_done", []))


@dataclass
class PreparedRequest:
    """Everything the engine needs, plus what the reply must report."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    deadline: float
    timeout_s: float
    session_id: str | None
    max_tokens: int
    max_tokens_clamped: bool
    stream: bool
    include_usage: bool
    # Filled while running; read by the access log.
    record: dict[str, Any] = field(default_factory=dict)


def _timeout_s(body: _GenerationFields, caller: Caller, default_s: float) -> float:
    if body.timeout is not None:
        return body.timeout
    header = caller.headers.get("x-request-timeout")
    if header is None:
        return default_s
    try:
        value = float(header)
    except ValueError:
        raise bad_request("X-Request-Timeout must be a number of seconds.", "X-Request-Timeout") from None
    if not 0 < value <= 3600:
        raise bad_request("X-Request-Timeout must be in (0, 3600] seconds.", "X-Request-Timeout")
    return value


def _session_id(body: _GenerationFields, caller: Caller, state: ServerState) -> str | None:
    session = caller.headers.get("x-session-id") or body.session_id or body.user
    if session is None:
        return None
    if len(session) > 256:
        raise bad_request("Session ids are limited to 256 characters.", "session_id")
    # With API keys, ids are namespaced per key so one tenant never sees another's.
    key_ns = caller.key_namespace
    return f"{key_ns}:{session}" if key_ns else session


def _resolve_max_tokens(state: ServerState, requested: int | None, num_prompt: int, max_model_len: int) -> tuple[int, bool]:
    """The max_tokens to run with, and whether a limit lowered the request's own value."""
    if num_prompt >= max_model_len:
        raise ContextLengthExceededError(num_prompt, requested or 1, max_model_len)
    room = max_model_len - num_prompt
    if requested is not None and requested > room:
        raise ContextLengthExceededError(num_prompt, requested, max_model_len)
    limit = min(state.config.max_tokens_limit, state.degrade.max_tokens_cap())
    if requested is None:
        return min(MAX_TOKENS_PRESETS[state.config.profile], limit, room), False
    applied = min(requested, limit)
    return applied, applied < requested


def _sampling(body: _GenerationFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        min_tokens=min(body.min_tokens, max_tokens),
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        min_p=body.min_p or 0.0,
        seed=body.seed,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=body.repetition_penalty or 1.0,
        stop=list(body.stop or []),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
    )


async def admit(state: ServerState, caller: Caller, prepared: PreparedRequest) -> None:
    """Wait for admission; the slot is given back when the exchange ends (``caller.on_done``)."""
    key = caller.key_namespace
    remaining = prepared.deadline - state.engine.engine.clock() if state.engine is not None else prepared.timeout_s
    await state.admission.admit(prepared.priority, len(prepared.prompt_ids), remaining, key)
    caller.on_done.append(lambda: state.admission.release(key))


def _precheck(state: ServerState, caller: Caller, body: _GenerationFields) -> None:
    """Refuse cheaply (full queue, shed priority) before tokenizing anything."""
    priority = parse_priority(body.priority, caller.headers.get("x-priority"))
    state.admission.precheck(priority, caller.key_namespace)


def _check_common(state: ServerState, body: _GenerationFields) -> None:
    if body.n is not None and body.n > 1:
        raise bad_request("n > 1 is not supported: send one request per completion.", "n", "unsupported_value")
    if body.model is not None and body.model not in (state.model_name, "ember", "default"):
        raise APIError(404, f"The model '{body.model}' does not exist. Available: '{state.model_name}'.", "invalid_request_error", "model", "model_not_found")


def engine_or_503(state: ServerState):
    if state.draining:
        raise unavailable("The server is shutting down; retry on another replica.", state.retry_after_s(), "draining")
    if not state.ready or state.engine is None:
        message = "The model is still loading." if state.load_error is None else f"The model failed to load: {state.load_error}"
        raise unavailable(message, state.retry_after_s(), "loading")
    return state.engine


def _finish_prepare(state: ServerState, caller: Caller, body: _GenerationFields, prompt: list[int], requested: int | None, logprobs: int | None) -> PreparedRequest:
    engine = engine_or_503(state)
    core = engine.engine
    try:
        max_tokens, clamped = _resolve_max_tokens(state, requested, len(prompt), core.max_model_len)
        params = _sampling(body, max_tokens, logprobs)
        core.check_prompt(prompt, params)
    except EmberError as exc:
        mapped = from_engine_error(exc)
        if mapped is None:
            raise
        raise mapped from None
    timeout_s = _timeout_s(body, caller, state.config.request_timeout_s)
    return PreparedRequest(
        request_id=caller.request_id,
        prompt_ids=prompt,
        params=params,
        priority=parse_priority(body.priority, caller.headers.get("x-priority")),
        deadline=core.clock() + timeout_s,
        timeout_s=timeout_s,
        session_id=_session_id(body, caller, state),
        max_tokens=max_tokens,
        max_tokens_clamped=clamped,
        stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
    )


def prepare_chat(state: ServerState, caller: Caller, body: ChatCompletionRequest) -> PreparedRequest:
    _check_common(state, body)
    engine_or_503(state)
    _precheck(state, caller, body)
    if len(body.messages) > state.config.max_messages:
        raise bad_request(f"Too many messages ({len(body.messages)}); the limit is {state.config.max_messages}.", "messages")
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true.", "top_logprobs")
    engine = engine_or_503(state)
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
    tokenizer = engine.tokenizer
    try:
        rendered = tokenizer.render_chat(messages)
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from None
    prompt = None
    sessions = engine.engine.sessions
    session_id = _session_id(body, caller, state)
    if sessions is not None and session_id is not None:
        # Keep the ids the model generated last turn, so the cached blocks match.
        prompt = sessions.prompt_ids(session_id, rendered, lambda text: tokenizer.encode(text, add_bos=False))
    if prompt is None:
        prompt = tokenizer.encode_rendered(rendered)
    requested = body.max_completion_tokens or body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return _finish_prepare(state, caller, body, prompt, requested, logprobs)


def prepare_completion(state: ServerState, caller: Caller, body: CompletionRequest) -> PreparedRequest:
    _check_common(state, body)
    engine_or_503(state)
    _precheck(state, caller, body)
    engine = engine_or_503(state)
    prompt_field: Any = body.prompt
    if isinstance(prompt_field, list) and prompt_field and isinstance(prompt_field[0], (str, list)):
        if len(prompt_field) != 1:
            raise bad_request("Batched prompts are not supported: send one request per prompt.", "prompt", "unsupported_value")
        prompt_field = prompt_field[0]
    if isinstance(prompt_field, str):
        prompt = engine.tokenizer.encode(prompt_field)
    else:
        prompt = [int(t) for t in prompt_field]
    if not prompt:
        raise bad_request("The prompt is empty.", "prompt")
    return _finish_prepare(state, caller, body, prompt, body.max_tokens, body.logprobs)


async def run(state: ServerState, prepared: PreparedRequest) -> AsyncIterator[RequestOutput]:
    """Generate, recording latency metrics; the caller frames the outputs."""
    engine = engine_or_503(state)
    metrics, model = state.metrics, state.model_name
    record = prepared.record
    record.update(prompt_tokens=len(prepared.prompt_ids), max_tokens=prepared.max_tokens)
    started = time.monotonic()
    last_token_at: float | None = None
    outputs = engine.generate(
        prepared.request_id,
        prepared.prompt_ids,
        prepared.params,
        priority=prepared.priority,
        deadline=prepared.deadline,
        session_id=prepared.session_id,
    )
    try:
        async for out in outputs:
            now = time.monotonic()
            if out.new_token_ids:
                if last_token_at is None:
                    record["ttft_s"] = now - started
                    metrics.ttft.labels(model, out.cache_tier).observe(now - started)
                    queue_s = (out.times.scheduled or out.times.arrival) - out.times.arrival
                    record["queue_s"] = queue_s
                    metrics.queue.labels(model).observe(queue_s)
                else:
                    metrics.itl.labels(model).observe(now - last_token_at)
                last_token_at = now
            if out.finished:
                record.update(
                    completion_tokens=out.num_output_tokens,
                    cached_tokens=out.num_cached_tokens,
                    cache_tier=out.cache_tier,
                    finish_reason=out.finish_reason.value if out.finish_reason else None,
                )
                metrics.prompt_tokens.labels(model).inc(out.num_prompt_tokens)
                metrics.generation_tokens.labels(model).inc(out.num_output_tokens)
                metrics.requests.labels(model, out.finish_reason.value if out.finish_reason else "unknown").inc()
                metrics.request_duration.labels(model).observe(now - started)
                state.degrade.observe(now - started, record.get("ttft_s"))
            yield out
    except ContextLengthExceededError as exc:  # validation raced with a change of limits
        raise bad_request(str(exc), "messages", "context_length_exceeded") from None
    finally:
        await outputs.aclose()
