"""The real chat page in front of a scripted model, for what a real model cannot be made to say on cue.

The embedded model's words are not under a test's control: no prompt makes it
answer ``<script>`` for certain, end mid-sentence with a deadline, or break off
with an error chunk. So these tests serve the page's real files (the same
``ember.webchat`` routes ``ember serve`` mounts) from a real HTTP server next
to a ``/v1/chat/completions`` that streams a scripted answer in Ember's exact
SSE shapes. The browser, the page's code, HTTP and SSE are all real; only the
words are chosen. Everything that a real server can show on cue (streaming,
tiers, stop, 429) is tested against ``ember serve`` in ``test_webchat_live``.

The scenario is the first word of the last user message:

- ``markup``: an answer full of HTML and dangerous links, then a normal finish;
- ``deadline``: a few words, then ``finish_reason: length`` with ``stop_reason: timeout``;
- ``broken``: a few words, then an error chunk and ``[DONE]``, as Ember sends after a failure;
- ``endless``: a few words, then nothing but SSE comments until the client goes away
  (``disconnected`` is set when it does);
- ``busy``: a 429 with ``retry-after-ms: 400`` and ``Retry-After: 5`` the first time,
  a normal answer after;
- anything else: a short echo.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ember import webchat

MODEL = "scripted-model"

MARKUP_ANSWER = [
    "Here is <script>window.__pwned = 1</script> and ",
    '<img src="x" onerror="window.__pwned = 2">, ',
    "a [bad link](javascript:window.__pwned=3), a [good link](https://example.com/a), ",
    "and **bold <b>tags</b>**:\n\n```html\n<iframe src=\"https://example.com\"></iframe>\n```\n",
]


def _chunk(delta: dict[str, Any] | None = None, finish: dict[str, Any] | None = None, usage: dict[str, Any] | None = None) -> bytes:
    choices = [] if usage else [{"index": 0, "delta": delta or {}, "logprobs": None, **(finish or {"finish_reason": None})}]
    body: dict[str, Any] = {"id": "chatcmpl-scripted", "object": "chat.completion.chunk", "created": int(time.time()), "model": MODEL, "choices": choices}
    if usage:
        body["usage"] = usage
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def _usage(completion_tokens: int, tier: str = "cold") -> dict[str, Any]:
    return {
        "prompt_tokens": 20,
        "completion_tokens": completion_tokens,
        "total_tokens": 20 + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": 0, "cache_tier": tier},
        "max_tokens": 80,
    }


class ScriptedChat:
    """The page's routes plus a scripted ``/v1``; records every chat request it receives."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []  # {"headers": {...}, "body": {...}}
        self.disconnected = threading.Event()
        self._busy_answered = False
        routes = [
            *webchat.routes(),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
        ]
        self.app = Starlette(routes=routes)

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _chat(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append({"headers": dict(request.headers), "body": body})
        scenario = body["messages"][-1]["content"].split()[0]
        if scenario == "busy" and not self._busy_answered:
            self._busy_answered = True
            error = {"error": {"message": "Too many requests are waiting.", "type": "rate_limit_error", "param": None, "code": "rate_limit_exceeded"}}
            return JSONResponse(error, status_code=429, headers={"Retry-After": "5", "retry-after-ms": "400"})
        return StreamingResponse(self._stream(scenario, body), media_type="text/event-stream")

    async def _stream(self, scenario: str, body: dict[str, Any]):
        yield _chunk({"role": "assistant", "content": ""})
        words = MARKUP_ANSWER if scenario == "markup" else ["The answer ", "starts ", "well ", "and then"]
        if scenario not in ("markup", "deadline", "broken", "endless"):
            words = ["You said: ", body["messages"][-1]["content"]]
        for word in words:
            await asyncio.sleep(0.02)  # separate chunks arrive separately, as tokens do
            yield _chunk({"content": word})
        if scenario == "endless":
            try:
                while True:  # a comment every 50 ms: the first send after the client left fails
                    await asyncio.sleep(0.05)
                    yield b": still thinking\n\n"
            finally:
                self.disconnected.set()
        if scenario == "broken":
            error = {"error": {"message": "Internal error while generating.", "type": "server_error", "param": None, "code": "internal_error"}}
            yield b"data: " + json.dumps(error).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
            return
        finish = {"finish_reason": "length", "stop_reason": "timeout"} if scenario == "deadline" else {"finish_reason": "stop", "stop_reason": None}
        yield _chunk(finish=finish)
        yield _chunk(usage=_usage(len(words)))
        yield b"data: [DONE]\n\n"


class ServerThread:
    """uvicorn serving an app on 127.0.0.1:<free port> from a daemon thread."""

    def __init__(self, app: Any) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the scripted server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        assert not self._thread.is_alive(), "the scripted server did not stop"
