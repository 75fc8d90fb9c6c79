"""A scriptable, fault-injecting OpenAI-compatible server on a real socket.

The app is plain ASGI so the same code runs under uvicorn (HTTP/1.1) and
hypercorn (HTTP/2). Each test scripts what the next requests get (``Reply``)
and afterwards inspects what the server saw (``Seen``).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

DEFAULT_USAGE = {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}


@dataclass
class Reply:
    """What the server does with one request.

    By default: a 200 SSE stream of ``deltas``, a final chunk with
    ``finish_reason``, a usage chunk when asked for, then ``data: [DONE]``.
    ``json`` replaces the stream by a JSON body (errors, non-streamed answers).
    The fault knobs act after ``n`` deltas: ``stall_after`` goes silent until the
    client leaves, ``drop_after`` breaks the connection, ``error_chunk`` sends an
    error object and ends the stream.
    """

    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    json: Any = None
    deltas: Sequence[str] = ("Hello", " world")
    role_chunk: bool = True
    finish_reason: str | None = "stop"
    done: bool = True
    header_delay_s: float = 0.0
    delta_delay_s: float = 0.0
    stall_after: int | None = None
    drop_after: int | None = None
    error_chunk: dict[str, Any] | None = None


@dataclass
class Seen:
    """One request as the server received it (header names lower-cased)."""

    method: str
    path: str
    headers: dict[str, str]
    body: Any
    client: tuple[str, int]
    http_version: str
    at: float


class FakeOpenAI:
    """ASGI app answering ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models``.

    Replies come from ``respond`` when set, else from ``script`` in order, else
    ``default``. ``GET /models`` always succeeds unless ``models_status`` says otherwise.
    """

    def __init__(self) -> None:
        self.script: list[Reply] = []
        self.default = Reply()
        self.respond: Callable[[Seen], Reply] | None = None
        self.models_status = 200
        self.seen: list[Seen] = []
        self.in_flight = 0
        self.max_in_flight = 0

    @property
    def completions(self) -> list[Seen]:
        """The chat and completion requests seen so far."""
        return [s for s in self.seen if s.path.endswith("completions")]

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        seen = Seen(
            method=scope["method"],
            path=scope["path"],
            headers={k.decode().lower(): v.decode() for k, v in scope["headers"]},
            body=json.loads(body) if body else None,
            client=tuple(scope["client"]),
            http_version=scope["http_version"],
            at=time.monotonic(),
        )
        self.seen.append(seen)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if seen.path.endswith("/models"):
                await _send_json(send, self.models_status, {"object": "list", "data": [{"id": "fake"}]}, {})
                return
            reply = self._next_reply(seen)
            await _answer(seen, reply, receive, send)
        finally:
            self.in_flight -= 1

    def _next_reply(self, seen: Seen) -> Reply:
        if self.respond is not None:
            return self.respond(seen)
        if self.script:
            return self.script.pop(0)
        return self.default


async def _answer(seen: Seen, reply: Reply, receive: Callable, send: Callable) -> None:
    headers = {"x-request-id": seen.headers.get("x-request-id", "none")}
    headers.update({name.lower(): value for name, value in reply.headers.items()})
    if reply.header_delay_s and await _client_left_within(receive, reply.header_delay_s):
        return
    if reply.json is not None or reply.status != 200:
        await _send_json(send, reply.status, reply.json if reply.json is not None else {}, headers)
        return
    headers["content-type"] = "text/event-stream"
    await send({"type": "http.response.start", "status": 200, "headers": _encode(headers)})
    chat = seen.path.endswith("chat/completions")
    if reply.role_chunk and chat:
        await _send_event(send, _chunk(chat, role="assistant"))
    for index, delta in enumerate(reply.deltas):
        if index == reply.stall_after:
            await _client_left_within(receive, 30.0)
            return
        if index == reply.drop_after:
            raise ConnectionAbortedError("fake server drops the connection mid-stream")
        if reply.delta_delay_s and await _client_left_within(receive, reply.delta_delay_s):
            return
        await _send_event(send, _chunk(chat, text=delta))
    if reply.stall_after is not None and reply.stall_after >= len(reply.deltas):
        await _client_left_within(receive, 30.0)
        return
    if reply.drop_after is not None and reply.drop_after >= len(reply.deltas):
        raise ConnectionAbortedError("fake server drops the connection mid-stream")
    if reply.error_chunk is not None:
        await _send_event(send, {"error": reply.error_chunk})
    else:
        await _send_event(send, _chunk(chat, finish_reason=reply.finish_reason))
        if (seen.body or {}).get("stream_options", {}).get("include_usage"):
            await _send_event(send, {"id": "cmpl-fake", "model": "fake", "choices": [], "usage": DEFAULT_USAGE})
    if reply.done:
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def _chunk(chat: bool, text: str | None = None, role: str | None = None, finish_reason: str | None = None) -> dict:
    if chat:
        delta = {k: v for k, v in (("role", role), ("content", text)) if v is not None}
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish_reason}
    return {"id": "cmpl-fake", "object": "chat.completion.chunk", "model": "fake", "choices": [choice]}


async def _send_event(send: Callable, payload: dict) -> None:
    data = f"data: {json.dumps(payload)}\n\n".encode()
    await send({"type": "http.response.body", "body": data, "more_body": True})


async def _send_json(send: Callable, status: int, payload: Any, headers: dict[str, str]) -> None:
    body = json.dumps(payload).encode()
    headers = {**headers, "content-type": "application/json", "content-length": str(len(body))}
    await send({"type": "http.response.start", "status": status, "headers": _encode(headers)})
    await send({"type": "http.response.body", "body": body})


async def _client_left_within(receive: Callable, seconds: float) -> bool:
    """Wait up to ``seconds``; True as soon as the client disconnects."""
    try:
        message = await asyncio.wait_for(receive(), seconds)
    except asyncio.TimeoutError:
        return False
    return message["type"] == "http.disconnect"


async def _lifespan(receive: Callable, send: Callable) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def _encode(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode(), v.encode()) for k, v in headers.items()]


def _listening_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # port 0: the kernel picks a free port, no race with other tests
    sock.listen(128)
    return sock


class RunningServer:
    """``app`` served on 127.0.0.1 in a background thread: uvicorn (HTTP/1.1) or hypercorn (HTTP/2)."""

    def __init__(self, app: FakeOpenAI, *, http2: bool = False) -> None:
        self.app = app
        self.http2 = http2
        sock = _listening_socket()
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self._stop: Callable[[], None]
        if http2:
            self._start_hypercorn(sock)
        else:
            self._start_uvicorn(sock)

    def _start_uvicorn(self, sock: socket.socket) -> None:
        import uvicorn

        config = uvicorn.Config(
            self.app, log_level="warning", lifespan="off", http="h11", access_log=False, timeout_graceful_shutdown=2
        )
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while not server.started and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.started, "uvicorn did not start"

        def stop() -> None:
            server.should_exit = True
            thread.join(10)

        self._stop = stop

    def _start_hypercorn(self, sock: socket.socket) -> None:
        from hypercorn.asyncio import serve
        from hypercorn.config import Config

        config = Config()
        config.bind = [f"fd://{sock.detach()}"]  # hypercorn takes the already-listening socket over
        config.loglevel = "WARNING"
        config.graceful_timeout = 2
        loop = asyncio.new_event_loop()
        shutdown = asyncio.Event()
        thread = threading.Thread(
            target=loop.run_until_complete, args=(serve(self.app, config, shutdown_trigger=shutdown.wait),), daemon=True
        )
        thread.start()

        def stop() -> None:
            loop.call_soon_threadsafe(shutdown.set)
            thread.join(10)
            loop.close()

        self._stop = stop

    def stop(self) -> None:
        self._stop()


def closed_port_url() -> str:
    """A base URL on which nothing listens: connecting is refused at once."""
    sock = _listening_socket()
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}/v1"
