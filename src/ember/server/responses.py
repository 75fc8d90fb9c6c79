"""Turn engine outputs into OpenAI replies: a full JSON object or an SSE stream.

Chat and legacy completions differ only in the shape of a choice, so each has
a small ``ReplyFormat`` whose ``Choice`` objects turn one choice's engine
outputs into stream pieces and a full choice (chat choices read tool calls out
of the text, server/tools.py); streaming, collecting, usage over the n
choices, deadlines and errors are shared here.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import Response, StreamingResponse

from ember.engine.api import RequestOutput, TokenLogprob
from ember.errors import EngineDeadError
from ember.server import sse
from ember.server.errors import APIError
from ember.server.generation import Caller, PreparedRequest, admit, run
from ember.server.protocol import chat_logprobs, finish_fields, new_id, now_s, usage
from ember.server.state import ServerState
from ember.server.tools import ReplyParser, ToolCallDelta

log = logging.getLogger("ember.server")


class ReplyFormat:
    """How one endpoint shapes its replies; ``choice(index)`` makes the per-choice state."""

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

    def choice(self, index: int) -> Choice:
        raise NotImplementedError

    def logprobs_field(self, entries: list[TokenLogprob]) -> dict[str, Any] | None:
        raise NotImplementedError


class Choice:
    """One choice of a reply as it is generated: its stream pieces, then its full form."""

    def __init__(self, fmt: ReplyFormat, index: int) -> None:
        self.fmt = fmt
        self.index = index
        self.text: list[str] = []
        self.logprobs: list[TokenLogprob] = []

    def first_delta(self) -> dict[str, Any] | None:
        """A piece sent before any token (chat: the role), or None."""
        return None

    def add(self, out: RequestOutput) -> list[dict[str, Any]]:
        """Take one engine output; return the choice pieces a stream sends for it."""
        raise NotImplementedError

    def finish(self, out: RequestOutput) -> dict[str, Any]:
        """The last stream piece: no new text, the finish reason."""
        raise NotImplementedError

    def full(self, out: RequestOutput) -> dict[str, Any]:
        """The whole choice for a non-streamed reply."""
        raise NotImplementedError


class ChatFormat(ReplyFormat):
    id_prefix = "chatcmpl"
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def choice(self, index: int) -> Choice:
        return ChatChoice(self, index)

    def logprobs_field(self, entries: list[TokenLogprob]) -> dict[str, Any] | None:
        if self.prepared.params.logprobs is None or not entries:
            return None
        return chat_logprobs(entries, self.token_text)


class ChatChoice(Choice):
    """A chat choice: content, or tool calls read from the text (server/tools.py)."""

    def __init__(self, fmt: ReplyFormat, index: int) -> None:
        super().__init__(fmt, index)
        tools = fmt.prepared.tools
        self.parser = ReplyParser(tools.mode if tools.calls_possible else "none")

    def first_delta(self) -> dict[str, Any]:
        # The role arrives at once, before the first token: the client knows it was accepted.
        return {"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def add(self, out: RequestOutput) -> list[dict[str, Any]]:
        self.text.append(out.text_delta)
        self.logprobs.extend(out.logprobs)
        content, calls = self.parser.feed(out.text_delta)
        logprobs = self.fmt.logprobs_field(out.logprobs)
        pieces: list[dict[str, Any]] = []
        if content or (logprobs and not calls):
            pieces.append({"index": self.index, "delta": {"content": content}, "logprobs": logprobs, "finish_reason": None})
        if calls:
            pieces.append(
                {
                    "index": self.index,
                    "delta": {"tool_calls": _merged(calls)},
                    "logprobs": None if pieces else logprobs,
                    "finish_reason": None,
                }
            )
        return pieces

    def _finish_fields(self, out: RequestOutput) -> dict[str, Any]:
        fields = finish_fields(out.finish_reason, out.stop_reason)
        if self.parser.made_calls and fields["finish_reason"] == "stop":
            fields["finish_reason"] = "tool_calls"
        return fields

    def finish(self, out: RequestOutput) -> dict[str, Any]:
        return {"index": self.index, "delta": {}, "logprobs": None, **self._finish_fields(out)}

    def full(self, out: RequestOutput) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.text)}
        if self.parser.made_calls and not self.parser.broken:
            message["content"] = None
            message["tool_calls"] = [call.openai() for call in self.parser.calls]
        return {"index": self.index, "message": message, "logprobs": self.fmt.logprobs_field(self.logprobs), **self._finish_fields(out)}


def _merged(deltas: list[ToolCallDelta]) -> list[dict[str, Any]]:
    """Call pieces of one output, one entry per call (a call's first piece keeps its id and name)."""
    merged: list[ToolCallDelta] = []
    for d in deltas:
        if merged and merged[-1].index == d.index and d.id is None:
            merged[-1] = ToolCallDelta(d.index, merged[-1].arguments + d.arguments, merged[-1].id, merged[-1].name)
        else:
            merged.append(d)
    return [d.openai() for d in merged]


class CompletionFormat(ReplyFormat):
    id_prefix = "cmpl"
    object_full = "text_completion"
    object_chunk = "text_completion"

    def choice(self, index: int) -> Choice:
        return CompletionChoice(self, index)

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


class CompletionChoice(Choice):
    """A text completion; with ``echo`` the prompt comes first."""

    def __init__(self, fmt: ReplyFormat, index: int) -> None:
        super().__init__(fmt, index)
        self.pending_echo = fmt.prepared.echo or ""

    def add(self, out: RequestOutput) -> list[dict[str, Any]]:
        self.text.append(out.text_delta)
        self.logprobs.extend(out.logprobs)
        text, self.pending_echo = self.pending_echo + out.text_delta, ""
        logprobs = self.fmt.logprobs_field(out.logprobs)
        if not text and not logprobs:
            return []
        return [{"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": None}]

    def finish(self, out: RequestOutput) -> dict[str, Any]:
        text, self.pending_echo = self.pending_echo, ""
        return {"index": self.index, "text": text, "logprobs": None, **finish_fields(out.finish_reason, out.stop_reason)}

    def full(self, out: RequestOutput) -> dict[str, Any]:
        text = (self.fmt.prepared.echo or "") + "".join(self.text)
        return {
            "index": self.index,
            "text": text,
            "logprobs": self.fmt.logprobs_field(self.logprobs),
            **finish_fields(out.finish_reason, out.stop_reason),
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


def _usage_of(finals: dict[int, RequestOutput], prepared: PreparedRequest) -> dict[str, Any]:
    """Usage of the whole reply: the prompt once, the completions of every choice."""
    first = finals[0]
    u = usage(
        first.num_prompt_tokens,
        sum(out.num_output_tokens for out in finals.values()),
        first.num_cached_tokens,
        first.cache_tier,
        sum(out.speculation.accepted_prediction_tokens or 0 for out in finals.values() if out.speculation),
        sum(out.speculation.rejected_prediction_tokens or 0 for out in finals.values() if out.speculation),
    )
    u["max_tokens"] = prepared.max_tokens
    return u


def streaming_reply(state: ServerState, http: HTTPRequest, prepared: PreparedRequest, fmt: ReplyFormat) -> StreamingResponse:
    headers = {**sse.headers_for(http.scope.get("http_version", "1.1")), **reply_headers(state, prepared)}
    return StreamingResponse(_stream(state, prepared, fmt), media_type="text/event-stream", headers=headers)


async def _stream(state: ServerState, prepared: PreparedRequest, fmt: ReplyFormat) -> AsyncIterator[bytes]:
    choices = [fmt.choice(i) for i in range(prepared.n)]
    for choice in choices:
        first = choice.first_delta()
        if first is not None:
            yield sse.event(fmt.envelope(fmt.object_chunk, [first]))
    finals: dict[int, RequestOutput] = {}
    try:
        async for index, out in run(state, prepared):
            choice = choices[index]
            for piece in choice.add(out):
                yield sse.event(fmt.envelope(fmt.object_chunk, [piece]))
            if out.finished:
                finals[index] = out
                yield sse.event(fmt.envelope(fmt.object_chunk, [choice.finish(out)]))
        if prepared.include_usage:
            yield sse.event({**fmt.envelope(fmt.object_chunk, []), "usage": _usage_of(finals, prepared)})
    except APIError as exc:
        _count_stream_error(state, prepared, exc.status)
        yield sse.error_event(exc.body())
    except Exception as exc:  # a server bug must still end the stream cleanly
        # A dead engine logged its own traceback; the streams it ended get one line each.
        log.error("stream %s failed: %s", prepared.request_id, exc, exc_info=not isinstance(exc, EngineDeadError))
        _count_stream_error(state, prepared, 500)
        yield sse.error_event(
            {"error": {"message": "Internal error while generating.", "type": "server_error", "param": None, "code": "internal_error"}}
        )
    yield sse.DONE


def _count_stream_error(state: ServerState, prepared: PreparedRequest, status: int) -> None:
    """An error after the stream started: the reply's status is 200 already, so
    without this it would be in the access log only, never in the error rate."""
    prepared.record["error"] = status
    state.metrics.errors.labels(state.model_name, str(status)).inc()


async def full_reply(state: ServerState, http: HTTPRequest, prepared: PreparedRequest, fmt: ReplyFormat) -> Response:
    """Collect the whole answer; a client that disconnects meanwhile aborts it."""
    choices = [fmt.choice(i) for i in range(prepared.n)]
    finals: dict[int, RequestOutput] = {}

    async def collect() -> None:
        async for index, out in run(state, prepared):
            choices[index].add(out)
            if out.finished:
                finals[index] = out

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
    body = {
        **fmt.envelope(fmt.object_full, [choice.full(finals[choice.index]) for choice in choices]),
        "usage": _usage_of(finals, prepared),
    }
    return Response(json.dumps(body, ensure_ascii=False).encode(), media_type="application/json", headers=reply_headers(state, prepared))


async def _wait_for_disconnect(http: HTTPRequest) -> None:
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            return
