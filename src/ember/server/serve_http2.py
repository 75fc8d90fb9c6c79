"""``ember serve --http2``: the same ASGI app under granian, HTTP/1.1 and HTTP/2 on one port.

On cleartext the port speaks HTTP/1.1 and h2c with prior knowledge (a client
that opens with the HTTP/2 preface, e.g. ``httpx.AsyncClient(http1=False,
http2=True)``); with ``--ssl-certfile`` ALPN offers ``h2`` and ``http/1.1``.
SSE streams are unchanged: each chunk is a DATA frame on the request's stream.

Why granian and not hypercorn or uvicorn: uvicorn has no HTTP/2, and of the
two that do, granian (its HTTP stack is Rust's hyper) spent 42 µs of server
CPU per streamed event at 64 streams on one HTTP/2 connection where hypercorn
(pure-Python h2) spent 96 µs and uvicorn's HTTP/1.1 54 µs (README,
"Transports"). Granian's embedded server runs the app on this process's
asyncio loop, so the gRPC server (started by the app's lifespan) shares the
loop, the engine and ``ServerState`` exactly as under uvicorn.

Drain semantics are uvicorn's ``DrainingServer``'s: the first SIGTERM or
SIGINT keeps the port open, answers new /v1 requests (and gRPC calls) with 503
(UNAVAILABLE), lets in-flight ones finish for up to ``drain_timeout_s``, aborts
the rest, then stops; the exit code is 0. A second signal stops at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path
from typing import Any

from ember.server.serve import drain, start_draining
from ember.server.state import ServerState

log = logging.getLogger("ember.server")

# Pending connections the kernel queues for us, as uvicorn's default; granian also
# uses it as the most requests it runs at once (admission control sits behind it).
BACKLOG = 2048


def serve_http2(app: Any, state: ServerState) -> int:
    """Block serving ``app`` until drained; returns the process exit code."""
    return asyncio.run(_serve(app, state))


async def _serve(app: Any, state: ServerState) -> int:
    try:
        from granian.constants import HTTPModes, Interfaces
        from granian.server.embed import Server
    except ImportError as exc:
        raise SystemExit(f"--http2 needs granian: pip install 'ember[http2]' ({exc})") from None
    config = state.config
    tls: dict[str, Any] = {}
    if config.ssl_certfile:
        if not config.ssl_keyfile:
            raise SystemExit("--ssl-certfile needs --ssl-keyfile")
        tls = {"ssl_cert": Path(config.ssl_certfile), "ssl_key": Path(config.ssl_keyfile)}
    server = Server(
        app,
        address=config.host,
        port=config.port,
        interface=Interfaces.ASGI,
        http=HTTPModes.auto,  # HTTP/1.1 and HTTP/2 on one port
        backlog=BACKLOG,
        log_enabled=False,  # keep Ember's logging configuration; granian logs through it
        log_access=False,  # Ember writes its own structured access line
        **tls,
    )
    stopping = _Stopper(server, state)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.on_signal, sig)
    log.info(
        "serving HTTP/1.1 and HTTP/2 (%s) on %s://%s:%d",
        "ALPN" if tls else "h2c prior knowledge",
        "https" if tls else "http",
        config.host,
        config.port,
    )
    await server.serve()
    if not stopping.requested:
        log.error("the HTTP server stopped on its own (see the errors above)")
        return 1
    return 0


class _Stopper:
    """First signal: drain, then stop the server. Second signal: stop now."""

    def __init__(self, server: Any, state: ServerState) -> None:
        self.server = server
        self.state = state
        self.requested = False
        self._draining: asyncio.Task[None] | None = None

    def on_signal(self, sig: int) -> None:
        self.requested = True
        if self._draining is not None:
            log.warning("second %s: stopping without waiting", signal.Signals(sig).name)
            self._draining.cancel()
            self.server.stop()
            return
        start_draining(self.state, sig)
        self._draining = asyncio.ensure_future(self._drain_then_stop())

    async def _drain_then_stop(self) -> None:
        await drain(self.state)
        self.server.stop()
