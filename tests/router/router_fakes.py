"""Test doubles for the router: fake OpenAI-compatible upstreams on real sockets.

``ServerThread`` runs any ASGI app with uvicorn in a background thread on a
free (or given) port. ``FakeUpstream`` is a tiny OpenAI-compatible replica that
streams ``chat.completion.chunk`` events token by token, can be switched into a
failure mode at any time, and records every request it saw.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

Mode = Literal["ok", "error500", "status503", "status429", "stall", "stall_mid", "drop"]


class ServerThread:
    """uvicorn serving ``app`` on 127.0.0.1 from a daemon thread."""

    def __init__(self, app: Any, port: int = 0, lifespan: str = "off") -> None:
        # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY only on sockets that
        # say so, and without it Nagle + delayed ACK add ~40 ms to every response.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        self.port: int = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app, log_level="critical", access_log=False, lifespan=lifespan, timeout_graceful_shutdown=1
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        wait_until(lambda: self._server.started or not self._thread.is_alive(), timeout_s=10)
        if not self._server.started:
            raise RuntimeError(f"server on port {self.port} did not start")

    def request_stop(self) -> None:
        self._server.should_exit = True

    def join(self) -> None:
        self._thread.join(timeout=10)
        assert not self._thread.is_alive(), "server thread did not stop"

    def stop(self) -> None:
        self.request_stop()
        self.join()


def stop_all(servers: list[ServerThread]) -> None:
    """Stop several servers at once (each shutdown takes ~0.2 s; in parallel they overlap)."""
    for server in servers:
        server.request_stop()
    for server in servers:
        server.join()


def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0, interval_s: float = 0.01) -> None:
    """Poll ``predicate`` until it holds; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        time.sleep(interval_s)


@dataclass
class SeenRequest:
    """One request as the fake upstream received it."""

    method: str
    path: str
    headers: dict[str, str]
    body: Any
    peer_port: int  # the client side of the TCP connection: equal ports, one kept-alive connection


class FakeUpstream:
    """An OpenAI-compatible replica whose behaviour tests switch at run time.

    Modes: ``ok``; ``error500`` (answers 500); ``status503`` (draining: requests
    and /ready answer 503); ``status429``; ``stall`` (a stream sends its headers,
    then nothing for ``stall_s``; a JSON request does not answer for ``stall_s``);
    ``stall_mid`` / ``drop`` (a stream sends ``drop_after_chunks`` chunks, then
    goes silent for ``stall_s`` / drops the connection).
    """

    def __init__(self, name: str, port: int = 0) -> None:
        self.name = name
        self.reset()
        self._server = ServerThread(self._build_app(), port=port)
        self.url = self._server.url
        self.port = self._server.port

    def reset(self) -> None:
        """Back to healthy with empty records (between tests)."""
        self.mode: Mode = "ok"
        self.ready_status = 200
        self.tokens = ["Hello", " from", f" {self.name}", "!"]
        self.chunk_delay_s = 0.0
        self.stall_s = 30.0
        self.drop_after_chunks = 2
        self.requests: list[SeenRequest] = []
        self.streams_finished = 0
        self.streams_cancelled = 0
        self.stream_cancelled = threading.Event()

    def completions_seen(self) -> list[SeenRequest]:
        """The generation requests (chat and text completions) this upstream received."""
        return [r for r in self.requests if r.path in ("/v1/chat/completions", "/v1/completions")]

    def stop(self) -> None:
        self._server.stop()

    @property
    def server(self) -> ServerThread:
        return self._server

    def _build_app(self) -> Starlette:
        async def ready(request: Request) -> Response:
            if self.ready_status == 503 or self.mode == "status503":
                return JSONResponse({"status": "draining"}, status_code=503, headers={"Retry-After": "1"})
            return JSONResponse({"status": "ready"}, status_code=self.ready_status)

        async def models(request: Request) -> Response:
            self._record(request, None)
            model = {"id": "fake-model", "object": "model", "owned_by": self.name}
            return JSONResponse({"object": "list", "data": [model]})

        async def session(request: Request) -> Response:
            self._record(request, None)
            return JSONResponse({"id": request.path_params["session_id"], "served_by": self.name})

        async def generate(request: Request) -> Response:
            try:
                body = json.loads(await request.body())
            except json.JSONDecodeError:
                self._record(request, None)
                return _error(400, "body is not JSON")
            self._record(request, body)
            chat = request.url.path.endswith("/chat/completions")
            if self.mode == "status503":
                return _error(503, "draining", {"Retry-After": "1"})
            if self.mode == "status429":
                return _error(429, "overloaded", {"Retry-After": "1"})
            if self.mode == "error500":
                return _error(500, "internal error")
            headers = {"x-upstream": self.name}
            if body.get("stream"):
                return StreamingResponse(self._stream(chat), media_type="text/event-stream", headers=headers)
            if self.mode == "stall":
                await asyncio.sleep(self.stall_s)
            return JSONResponse(self._full_response(chat), headers=headers)

        return Starlette(
            routes=[
                Route("/ready", ready),
                Route("/health", lambda request: JSONResponse({"status": "ok"})),
                Route("/v1/models", models),
                Route("/v1/sessions/{session_id}", session, methods=["GET", "DELETE"]),
                Route("/v1/chat/completions", generate, methods=["POST"]),
                Route("/v1/completions", generate, methods=["POST"]),
            ]
        )

    def _record(self, request: Request, body: Any) -> None:
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in request.scope["headers"]}
        peer_port = request.client.port if request.client else 0
        self.requests.append(SeenRequest(request.method, request.url.path, headers, body, peer_port))

    async def _stream(self, chat: bool):
        finished = False
        try:
            if self.mode == "stall":
                await asyncio.sleep(self.stall_s)
            for index, token in enumerate(self.tokens):
                if self.mode == "drop" and index == self.drop_after_chunks:
                    raise ConnectionAbortedError("fake upstream drops the connection mid-stream")
                if self.mode == "stall_mid" and index == self.drop_after_chunks:
                    await asyncio.sleep(self.stall_s)
                if index and self.chunk_delay_s:
                    await asyncio.sleep(self.chunk_delay_s)
                yield _sse(_chunk(chat, token, None))
            yield _sse(_chunk(chat, "", "stop"))
            yield b"data: [DONE]\n\n"
            finished = True
        finally:
            if finished:
                self.streams_finished += 1
            else:
                self.streams_cancelled += 1
                self.stream_cancelled.set()

    def _full_response(self, chat: bool) -> dict[str, Any]:
        text = "".join(self.tokens)
        usage = {"prompt_tokens": 3, "completion_tokens": len(self.tokens), "total_tokens": 3 + len(self.tokens)}
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
            head = {"id": "chatcmpl-fake", "object": "chat.completion"}
        else:
            choice = {"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}
            head = {"id": "cmpl-fake", "object": "text_completion"}
        return {**head, "created": 0, "model": "fake-model", "choices": [choice], "usage": usage}


def _chunk(chat: bool, token: str, finish_reason: str | None) -> dict[str, Any]:
    if chat:
        delta = {"content": token} if token else {}
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        head = {"id": "chatcmpl-fake", "object": "chat.completion.chunk"}
    else:
        choice = {"index": 0, "text": token, "finish_reason": finish_reason, "logprobs": None}
        head = {"id": "cmpl-fake", "object": "text_completion"}
    return {**head, "created": 0, "model": "fake-model", "choices": [choice]}


def _sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": str(status)}}
    return JSONResponse(body, status_code=status, headers=headers)


def sse_events(lines: list[str]) -> list[Any]:
    """Decoded ``data:`` payloads of SSE lines (``[DONE]`` kept as the string)."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def streamed_text(sse_body: str) -> str:
    """The assistant text of a whole chat SSE response body."""
    return "".join(
        event["choices"][0]["delta"].get("content", "")
        for event in sse_events(sse_body.splitlines())
        if isinstance(event, dict) and "choices" in event
    )
