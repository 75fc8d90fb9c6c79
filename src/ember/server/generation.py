"""From a validated request to engine outputs: prompt, limits, deadline, metrics.

Routes call ``prepare_*`` (which raises ``APIError`` for any client mistake,
before a byte of the reply is sent) and then iterate ``run``. The same code
serves chat and completions, streaming or not, over HTTP or gRPC: what it
needs from the request besides the body is a ``Caller`` (headers or metadata,
the request id, the API key's namespace), not a Starlette request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.requests import Request as HTTPRequest

from ember.engine.api import AsyncEngine, Constraint, RequestOutput, SamplingParams
from ember.errors import ContextLengthExceededError, EmberError
from ember.server.defaults import GenerationDefaults
from ember.server.errors import APIError, bad_request, from_engine_error, unavailable
from ember.server.protocol import ChatCompletionRequest, CompletionRequest, _GenerationFields, parse_priority
from ember.server.request_ids import engine_request_id
from ember.server.state import ServerState
from ember.server.structured import chat_grammar, compile_constraints
from ember.server.tools import ToolSpec, render_messages, tool_spec
from ember.server.unsupported import CHAT_UNSUPPORTED, COMPLETION_UNSUPPORTED, refuse_unsupported, unsupported_value

# Most choices one request may ask for (n); each is an engine request.
MAX_CHOICES = 16


@dataclass
class Caller:
    """What generation needs to know about a request besides its body, whatever the wire.

    ``headers`` are lower-case names (HTTP headers or gRPC metadata):
    ``x-request-timeout``, ``x-session-id`` and ``x-priority`` are read.
    ``on_done`` callbacks run once when the exchange ends, however it ends
    (e.g. giving the admission slot back); whoever made the Caller runs them.
    ``arrived`` (``time.monotonic``) is when the request reached the server:
    every latency the server records (end to end, first token, queue wait)
    counts from there, so time spent waiting for admission is never hidden.
    """

    request_id: str
    headers: Mapping[str, str]
    key_namespace: str | None = None
    on_done: list[Callable[[], None]] = field(default_factory=list)
    arrived: float = field(default_factory=time.monotonic)

    @classmethod
    def from_http(cls, http: HTTPRequest) -> Caller:
        """The Caller of an HTTP request; ``on_done`` is the list the middleware runs."""
        s = http.scope["state"]
        return cls(
            s["request_id"], http.headers, s.get("api_key_namespace"), s.setdefault("on_done", []), s.get("arrived", time.monotonic())
        )


@dataclass
class PreparedRequest:
    """Everything the engine needs, plus what the reply must report.

    ``request_id`` is the client's (echoed, logged); ``engine_id`` is unique
    in the process, since clients may reuse theirs.
    """

    request_id: str
    engine_id: str
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
    # Choices (n): each is an engine request; copies after the first share the
    # prompt's KV through the prefix cache.
    n: int = 1
    # The grammar of each choice (None: free text), from response_format or tools.
    constraints: list[Constraint | None] = field(default_factory=lambda: [None])
    tools: ToolSpec = field(default_factory=lambda: ToolSpec("none"))
    # Completions with echo: the prompt text that comes before each choice's text.
    echo: str | None = None
    # Chat with ``prediction``: its token ids, drafted from (engine/speculation.py).
    prediction_ids: list[int] | None = None
    # Filled while running; read by the access log.
    record: dict[str, Any] = field(default_factory=dict)
    # When the request reached the server (time.monotonic), and how long it
    # then waited for admission (set by admit()).
    arrived: float = field(default_factory=time.monotonic)
    admission_wait_s: float = 0.0


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
        return min(state.defaults.get("max_tokens"), limit, room), False
    applied = min(requested, limit)
    return applied, applied < requested


def _sampling(body: _GenerationFields, max_tokens: int, logprobs: int | None, defaults: GenerationDefaults) -> SamplingParams:
    """Engine params: the request's fields, the server's defaults where it sets none."""

    def pick(value: Any, name: str) -> Any:
        return defaults.get(name) if value is None else value

    return SamplingParams(
        max_tokens=max_tokens,
        min_tokens=min(body.min_tokens, max_tokens),
        temperature=pick(body.temperature, "temperature"),
        top_p=pick(body.top_p, "top_p"),
        top_k=pick(body.top_k, "top_k"),
        min_p=pick(body.min_p, "min_p"),
        seed=body.seed,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=pick(body.repetition_penalty, "repetition_penalty"),
        stop=list(body.stop or []),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        logit_bias={int(k): float(v) for k, v in (body.logit_bias or {}).items()},
    )


async def admit(state: ServerState, caller: Caller, prepared: PreparedRequest) -> None:
    """Wait for admission; the slot is given back when the exchange ends (``caller.on_done``).

    The wait is recorded in ``prepared.admission_wait_s``. A request whose
    deadline passed while it waited never reaches the engine, but its wait is
    the clearest sign of overload there is: it goes into the queue histogram
    and to the degradation controller all the same.
    """
    key = caller.key_namespace
    remaining = prepared.deadline - state.engine.clock() if state.engine is not None else prepared.timeout_s
    try:
        await state.admission.admit(prepared.priority, len(prepared.prompt_ids), remaining, key)
    except APIError:
        waited = time.monotonic() - prepared.arrived
        if state.engine is not None and state.engine.clock() >= prepared.deadline:
            state.metrics.queue.labels(state.model_name).observe(waited)
            state.degrade.observe_start(waited)
        raise
    prepared.admission_wait_s = time.monotonic() - prepared.arrived
    caller.on_done.append(lambda: state.admission.release(key))


def _precheck(state: ServerState, caller: Caller, body: _GenerationFields) -> None:
    """Refuse cheaply (full queue, shed priority) before tokenizing anything."""
    priority = parse_priority(body.priority, caller.headers.get("x-priority"))
    state.admission.precheck(priority, caller.key_namespace)


def _check_common(state: ServerState, body: _GenerationFields) -> None:
    if body.n is not None and body.n > MAX_CHOICES:
        raise unsupported_value(f"n may be at most {MAX_CHOICES}; send several requests for more choices.", "n")
    if body.model is not None and body.model not in (state.model_name, "ember", "default"):
        raise APIError(
            404,
            f"The model '{body.model}' does not exist. Available: '{state.model_name}'.",
            "invalid_request_error",
            "model",
            "model_not_found",
        )


def engine_or_503(state: ServerState) -> AsyncEngine:
    if state.draining:
        raise unavailable("The server is shutting down; retry on another replica.", state.retry_after_s(), "draining")
    if not state.ready or state.engine is None:
        message = "The model is still loading." if state.load_error is None else f"The model failed to load: {state.load_error}"
        raise unavailable(message, state.retry_after_s(), "loading")
    return state.engine


def _finish_prepare(
    state: ServerState,
    caller: Caller,
    body: _GenerationFields,
    prompt: list[int],
    requested: int | None,
    logprobs: int | None,
    constraints: list[Constraint | None] | None = None,
) -> PreparedRequest:
    engine = engine_or_503(state)
    try:
        max_tokens, clamped = _resolve_max_tokens(state, requested, len(prompt), engine.info.max_model_len)
        params = _sampling(body, max_tokens, logprobs, state.defaults)
        engine.check_prompt(prompt, params)
    except EmberError as exc:
        mapped = from_engine_error(exc)
        if mapped is None:
            raise
        raise mapped from None
    timeout_s = _timeout_s(body, caller, state.config.request_timeout_s)
    if clamped:
        state.metrics.max_tokens_clamped.labels(state.model_name).inc()
    return PreparedRequest(
        request_id=caller.request_id,
        engine_id=engine_request_id(caller.request_id),
        arrived=caller.arrived,
        prompt_ids=prompt,
        params=params,
        priority=parse_priority(body.priority, caller.headers.get("x-priority")),
        deadline=engine.clock() + timeout_s,
        timeout_s=timeout_s,
        session_id=_session_id(body, caller, state),
        max_tokens=max_tokens,
        max_tokens_clamped=clamped,
        stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        n=body.n or 1,
        constraints=constraints or [None] * (body.n or 1),
    )


def prepare_chat(state: ServerState, caller: Caller, body: ChatCompletionRequest) -> PreparedRequest:
    refuse_unsupported(body, CHAT_UNSUPPORTED)
    _check_common(state, body)
    engine_or_503(state)
    _precheck(state, caller, body)
    if len(body.messages) > state.config.max_messages:
        raise bad_request(f"Too many messages ({len(body.messages)}); the limit is {state.config.max_messages}.", "messages")
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true.", "top_logprobs")
    engine = engine_or_503(state)
    tools = tool_spec(body)
    tokenizer = engine.tokenizer
    messages, template_tools = render_messages(body.messages, tools, tokenizer.template_renders_tools)
    grammar, grammar_param = chat_grammar(body, tools)
    constraints = compile_constraints(engine, grammar, grammar_param, body.n or 1)
    try:
        rendered = tokenizer.render_chat(messages, tools=template_tools)
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from None
    prompt = None
    session_id = _session_id(body, caller, state)
    if session_id is not None:
        # Keep the ids the model generated last turn, so the cached blocks match.
        prompt = engine.session_prompt_ids(session_id, rendered, lambda text: tokenizer.encode(text, add_bos=False))
    if prompt is None:
        prompt = tokenizer.encode_rendered(rendered)
    requested = body.max_completion_tokens or body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    prepared = _finish_prepare(state, caller, body, prompt, requested, logprobs, constraints)
    prepared.tools = tools
    if body.prediction is not None and (text := body.prediction.text()):
        prepared.prediction_ids = tokenizer.encode(text, add_bos=False)
    return prepared


def prepare_completion(state: ServerState, caller: Caller, body: CompletionRequest) -> PreparedRequest:
    refuse_unsupported(body, COMPLETION_UNSUPPORTED)
    _check_common(state, body)
    if body.echo and body.logprobs is not None:
        raise unsupported_value("echo with logprobs would need the prompt's log-probabilities, which Ember does not compute.", "echo")
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
    prepared = _finish_prepare(state, caller, body, prompt, body.max_tokens, body.logprobs)
    if body.echo:
        prepared.echo = prompt_field if isinstance(prompt_field, str) else engine.tokenizer.decode(prompt, skip_special_tokens=False)
    return prepared


async def run(state: ServerState, prepared: PreparedRequest) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Generate every choice, recording latency metrics; yields (choice index, output) as they come.

    With n > 1, every choice is submitted at once, choice 0 first: the copies
    are admitted in the step that schedules choice 0's prompt or in a later one,
    and either way reference its prompt blocks instead of computing them
    (in-step prefix sharing, ``KVCacheManager.publish_scheduled``).
    """
    if prepared.n == 1:
        async for out in _run_choice(state, prepared, 0):
            yield 0, out
        return
    results: asyncio.Queue[tuple[int, RequestOutput | Exception | None]] = asyncio.Queue()

    async def pump(index: int) -> None:
        try:
            async for out in _run_choice(state, prepared, index):
                await results.put((index, out))
            await results.put((index, None))
        except Exception as exc:  # handed to the consumer, which raises it
            await results.put((index, exc))

    tasks = [asyncio.ensure_future(pump(i)) for i in range(prepared.n)]  # tasks start in this order
    try:
        running = prepared.n
        while running:
            index, item = await results.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()  # each choice's generator aborts its engine request
        await asyncio.gather(*tasks, return_exceptions=True)


async def _run_choice(state: ServerState, prepared: PreparedRequest, index: int) -> AsyncGenerator[RequestOutput, None]:
    """One choice's engine request; metrics per engine request, the access record summed over choices.

    Latencies count from the request's arrival at the server, so end to end
    and time to first token include the wait for admission; the queue wait is
    the admission wait plus the wait in the engine's own queue.
    """
    engine = engine_or_503(state)
    metrics, model, degrade = state.metrics, state.model_name, state.degrade
    record = prepared.record
    record.update(prompt_tokens=len(prepared.prompt_ids), max_tokens=prepared.max_tokens)
    started = prepared.arrived
    last_token_at: float | None = None
    params = prepared.params
    if index and params.seed is not None:
        params = replace(params, seed=(params.seed + index) % 2**64)  # copies must differ
    outputs = engine.generate(
        prepared.engine_id if index == 0 else f"{prepared.engine_id}-{index}",
        prepared.prompt_ids,
        params,
        priority=prepared.priority,
        deadline=prepared.deadline,
        # The conversation continues from one choice: only the first keeps the session.
        session_id=prepared.session_id if index == 0 else None,
        constraint=prepared.constraints[index],
        prediction=prepared.prediction_ids,
    )
    try:
        async for out in outputs:
            now = time.monotonic()
            if out.new_token_ids:
                if last_token_at is None:
                    ttft_s = now - started
                    queue_s = prepared.admission_wait_s + (out.times.scheduled or out.times.arrival) - out.times.arrival
                    record.setdefault("ttft_s", ttft_s)
                    record.setdefault("queue_s", queue_s)
                    metrics.ttft.labels(model, out.cache_tier).observe(ttft_s)
                    metrics.queue.labels(model).observe(queue_s)
                    if index == 0:  # the controller counts requests, not copies
                        degrade.observe_start(queue_s, ttft_s)
                else:
                    metrics.itl.labels(model).observe(now - last_token_at)
                    degrade.observe_itl(now - last_token_at)
                last_token_at = now
            if out.finished:
                record["completion_tokens"] = record.get("completion_tokens", 0) + out.num_output_tokens
                if (spec := out.speculation) is not None and spec.draft_tokens:
                    record["draft_tokens"] = record.get("draft_tokens", 0) + spec.draft_tokens
                    record["accepted_draft_tokens"] = record.get("accepted_draft_tokens", 0) + spec.accepted_tokens
                    metrics.spec_draft_tokens.labels(model).inc(spec.draft_tokens)
                    metrics.spec_accepted_tokens.labels(model).inc(spec.accepted_tokens)
                if index == 0:
                    record.update(
                        cached_tokens=out.num_cached_tokens,
                        cache_tier=out.cache_tier,
                        finish_reason=out.finish_reason.value if out.finish_reason else None,
                    )
                    degrade.observe_e2e(now - started)
                metrics.prompt_tokens.labels(model).inc(out.num_prompt_tokens)
                metrics.generation_tokens.labels(model).inc(out.num_output_tokens)
                metrics.requests.labels(model, out.finish_reason.value if out.finish_reason else "unknown").inc()
                metrics.request_duration.labels(model).observe(now - started)
            yield out
    except ContextLengthExceededError as exc:  # validation raced with a change of limits
        raise bad_request(str(exc), "messages", "context_length_exceeded") from None
    finally:
        await outputs.aclose()
