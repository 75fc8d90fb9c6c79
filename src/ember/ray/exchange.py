"""One HTTP request carried between Ray processes, and run through an ASGI app in process.

The ingress (ingress.py) reads the client's request into an ``HttpExchange``
and sends it to a replica with a deployment-handle call; the replica runs it
through the very app ``ember serve`` serves (``create_app``) with
``run_asgi`` and streams the app's ASGI messages back, a batch per Ray
message. No Ray here: the runner is tested on its own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

Message = dict[str, Any]
RawHeaders = list[tuple[bytes, bytes]]
ASGIApp = Callable[..., Any]

log = logging.getLogger("ember.ray")

_END = object()  # queued after the app's last message


@dataclass(frozen=True, slots=True)
class HttpExchange:
    """What an app needs of a client's HTTP request: the fields of an ASGI ``http`` scope, and the body."""

    method: str
    path: str
    query_string: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""
    client: tuple[str, int] | None = None
    scheme: str = "http"
    http_version: str = "1.1"

    def scope(self) -> dict[str, Any]:
        """A fresh ASGI scope (``state`` is per request, as uvicorn makes it)."""
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": self.http_version,
            "method": self.method,
            "scheme": self.scheme,
            "path": self.path,
            "raw_path": self.path.encode("latin-1", "replace"),
            "root_path": "",
            "query_string": self.query_string,
            "headers": list(self.headers),
            "client": self.client,
            "server": None,
            "state": {},
        }


def error_messages(status: int, body: bytes, headers: Sequence[tuple[bytes, bytes]] = ()) -> list[Message]:
    """A complete JSON response as ASGI messages."""
    start_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
    return [
        {"type": "http.response.start", "status": status, "headers": start_headers},
        {"type": "http.response.body", "body": body, "more_body": False},
    ]


_INTERNAL_ERROR = b'{"error":{"message":"Internal server error.","type":"server_error","param":null,"code":"internal_error"}}'


async def run_asgi(app: ASGIApp, exchange: HttpExchange, extra_headers: Sequence[tuple[bytes, bytes]] = ()) -> AsyncIterator[list[Message]]:
    """Run ``exchange`` through ``app``; yield its messages, as many per batch as are ready.

    ``extra_headers`` are appended to the response's start message. Leaving
    the iterator early (the caller went away) is a client disconnect to the
    app: its ``receive`` answers ``http.disconnect`` and the app task is
    cancelled, which aborts the engine request. An app that raises before it
    started a response answers 500 in the OpenAI error shape.
    """
    queue: asyncio.Queue[Any] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False
    started = False

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": exchange.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal started
        if disconnected.is_set():
            raise OSError("the client disconnected")
        if message["type"] == "http.response.start":
            started = True
            if extra_headers:
                message = {**message, "headers": [*message.get("headers", ()), *extra_headers]}
        queue.put_nowait(message)

    task = asyncio.ensure_future(app(exchange.scope(), receive, send))
    # Done callbacks run after the task's last send: _END is always the last item.
    task.add_done_callback(lambda _: queue.put_nowait(_END))
    try:
        while True:
            batch = [await queue.get()]
            while not queue.empty():
                batch.append(queue.get_nowait())
            ended = batch[-1] is _END
            if ended:
                batch.pop()
            if batch:
                yield batch
            if ended:
                break
        error = None if task.cancelled() else task.exception()
        if error is not None:
            # Starlette re-raises after its 500 response; uvicorn would log it, so do we.
            log.error("unhandled error in %s %s", exchange.method, exchange.path, exc_info=error)
            if not started:
                yield error_messages(500, _INTERNAL_ERROR, list(extra_headers))
    finally:
        if not task.done():
            disconnected.set()
            task.cancel()
