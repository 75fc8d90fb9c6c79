"""Turn engine outputs into OpenAI replies: a full JSON object or an SSE stream.

Chat and legacy completions differ only in the shape of a choice, so each has
a small ``ReplyFormat``; streaming, collecting, usage, deadlines and errors are
shared here.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator, Callable

from starlette.requests import Request as HTTPRequest
from starlette.responses import Response, StreamingResponse

from ember.engine.request import RequestOutput, TokenLogprob
from ember.server import sse
from ember.server.errors import APIError
from ember.server.generation import Caller, PreparedRequest, admit, run
from ember.server.protocol import chat_logprobs, finish_fields, new_id, now_s, usage
from ember.server.state import ServerState

log = logging.getLogger("ember.server")


class ReplyFormat:
    """How one endpoint shapes its choices (see ``ChatFormat`` and ``CompletionFormat``)."""

    id_prefix = "x"
    object_full = ""
    object_chunk = ""

    def __init__(self, state: ServerState, prepared: PreparedRequest) -> None:
        self.state = state
        self.prepared = prepared
        self.id = new_id(self.id_prefix)
        self.created = now_s()

    def envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.state.model_name, "choices": choices}

    def token_text(self, token_id: int) -> str:
        assert self.state.engine is not None
        return self.state.engine.tokenizer.decode([token_id], skip_special_tokens=False)

    def first_chunk(self) -> dict[str, Any] | None:
        return None

    def delta_choice(self, text: str, logprobs: list[TokenLogprob]) -> dict[str, Any]:
        raise NotImplementedError

    def final_choice_delta(self) -> dict[str, Any]:
        raise NotImplementedError

    def full_choice(self, text: str, logprobs: list[TokenLogprob]) -> dict[str, Any]:
        raise NotImplementedError

    def logprobs_field(self, entries: list[TokenLogprob]) -> dict[str, Any] | None:
        raise NotImplementedError


class ChatFormat(ReplyFormat):
    id_prefix = "chatcmpl"
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def first_chunk(self) -> dict[str, Any]:
        # The role arrives at once, before the first token: the client knows it was accepted.
        return self.envelope(self.object_chunk, [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])

    def delta_choice(self, text: str, logprobs: list[TokenLogprob]) -> dict[str, Any]:
        return {"index": 0, "delta": {"content": text}, "logprobs": self.logprobs_field(logprobs), "finish_reason": None}

    def final_choice_delta(self) -> dict[str, Any]:
        return {"index": 0, "delta": {}, "logprobs": None}

    def full_choice(self, text: str, logprobs: list[TokenLogprob]) -> dict[str, Any]:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": self.logprobs_field(logprobs)}

    def logprobs_field(self, entries: list[TokenLogprob]) -> dict[str, Any] | None:
        if self.prepared.params.logprobs is None or not entries:
            return None
        return chat_logprobs(entries, self.token_text)


class CompletionFormat(ReplyFormat):
    id_prefix = "cmpl"
    object_full = "text_completion"
    object_chunk = "text_completion"

    def delta_choice(self, text: str, logprobs: list[TokenLogprob]) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": self.logprobs_field(logprobs), "finish_reason": None}

    def final_choice_delta(self) -> dict[str, Any]:
        return {"index": 0, "text": "", "logprobs": None}

    def full_choice(self, text: str, logprobs: list[TokenLogprob]) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": self.logprobs_field(logprobs)}

    def logprobs_field(self, entries: list[TokenLogprob]) -> dict[str, Any] | None:
        if self.prepared.params.logprobs is None or not entries:
            return None
        tokens = [self.token_text(e.token_id) for e in entries]
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self.token_text(t): lp for t, lp in e.top} for e in entries],
            "text_offset": [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))],
        }


async def respond(http: HTTPRequest, body: Any, prepare: Callable[..., PreparedRequest], fmt_class: type[ReplyFormat]) -> Response:
    """The whole of a generation route: validate, admit, then stream or answer in full."""
    state = http.app.state.ember
    caller = Caller.from_http(http)
    prepared = prepare(state, caller, body)
    prepared.record = http.scope["state"]["record"]
    await admit(state, caller, prepared)
    fmt = fmt_class(state, prepared)
    if prepared.stream:
        return streaming_reply(state, http, prepared, fmt)
    return await full_reply(state, http, prepared, fmt)


def reply_headers(state: ServerState, prepared: PreparedRequest) -> dict[str, str]:
    """Headers telling the client which limits were applied."""
    headers = {"X-Ember-Max-Tokens": str(prepared.max_tokens)}
    if prepared.max_tokens_clamped:
        headers["X-Ember-Max-Tokens-Clamped"] = "1"
    if state.degrade.degraded:
        headers["X-Ember-Degraded"] = "1"
    return headers


def _usage_of(out: RequestOutput, prepared: PreparedRequest) -> dict[str, Any]:
    u = usage(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens)
    u["max_tokens"] = prepared.max_tokens
    return u


def streaming_reply(state: ServerState, http: HTTPRequest, prepared: PreparedRequest, fmt: ReplyFormat) -> StreamingResponse:
    headers = {**sse.headers_for(http.scope.get("http_version", "1.1")), **reply_headers(state, prepared)}
    return StreamingResponse(_stream(state, prepared, fmt), media_type="text/event-stream", headers=headers)


async def _stream(state: ServerState, prepared: PreparedRequest, fmt: ReplyFormat) -> AsyncIterator[bytes]:
    first = fmt.first_chunk()
    if first is not None:
        yield sse.event(first)
    try:
        async for out in run(state, prepared):
            if out.text_delta or (out.logprobs and prepared.params.logprobs is not None):
                yield sse.event(fmt.envelope(fmt.object_chunk, [fmt.delta_choice(out.text_delta, out.logprobs)]))
            if out.finished:
                final = {**fmt.final_choice_delta(), **finish_fields(out.finish_reason, out.stop_reason)}
                yield sse.event(fmt.envelope(fmt.object_chunk, [final]))
                if prepared.include_usage:
                    yield sse.event({**fmt.envelope(fmt.object_chunk, []), "usage": _usage_of(out, prepared)})
    except APIError as exc:
        prepared.record["error"] = exc.status
        yield sse.error_event(exc.body())
    except Exception:  # a server bug must still end the stream cleanly
        log.exception("stream %s failed", prepared.request_id)
        prepared.record["error"] = 500
        yield sse.error_event({"error": {"message": "Internal error while generating.", "type": "server_error", "param": None, "code": "internal_error"}})
    yield sse.DONE


async def full_reply(state: ServerState, http: HTTPRequest, prepared: PreparedRequest, fmt: ReplyFormat) -> Response:
    """Collect the whole answer; a client that disconnects meanwhile aborts it."""
    text: list[str] = []
    logprobs: list[TokenLogprob] = []
    final: list[RequestOutput] = []

    async def collect() -> None:
        async for out in run(state, prepared):
            text.append(out.text_delta)
            logprobs.extend(out.logprobs)
            if out.finished:
                final.append(out)

    collecting = asyncio.ensure_future(collect())
    disconnected = asyncio.ensure_future(_wait_for_disconnect(http))
    try:
        await asyncio.wait({collecting, disconnected}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnected.cancel()
        if not collecting.done():
            collecting.cancel()  # the generator's cleanup aborts the engine request
            prepared.record["error"] = 499
    try:
        await collecting
    except asyncio.CancelledError:
        return Response(status_code=499)
    out = final[0]
    choice = {**fmt.full_choice("".join(text), logprobs), **finish_fields(out.finish_reason, out.stop_reason)}
    body = {**fmt.envelope(fmt.object_full, [choice]), "usage": _usage_of(out, prepared)}
    return Response(json.dumps(body, ensure_ascii=False).encode(), media_type="application/json", headers=reply_headers(state, prepared))


async def _wait_for_disconnect(http: HTTPRequest) -> None:
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            return
