"""Run the server under uvicorn (or granian with ``--http2``), with a graceful drain on SIGTERM.

uvicorn's own shutdown closes the listening socket at once, so a client that
connects during shutdown gets "connection refused" and cannot tell a drain from
a crash. Ember drains first: on SIGTERM (or the first Ctrl-C) it keeps
listening, answers new /v1 requests with 503 + Retry-After, lets in-flight
requests finish for up to ``drain_timeout_s``, aborts what is left, and only then
lets uvicorn shut down. The process exits 0. A second signal forces the exit.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import replace
from types import FrameType
from typing import Any

import uvicorn

from ember.config import EngineConfig, ServerConfig, SessionConfig
from ember.engine.api import AsyncEngine, check_chat_template_file
from ember.server.app import create_app
from ember.server.state import ServerState

log = logging.getLogger("ember.server")


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first exit signal starts a drain instead of a shutdown."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.ember = state
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in _captured_signals: uvicorn would re-raise it after
        # shutdown and the process would die by signal instead of exiting 0.
        if self.ember.draining or self._loop is None:
            self.should_exit = True
            self.force_exit = self.ember.draining
            return
        start_draining(self.ember, sig)
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        await drain(self.ember)
        self.should_exit = True


def start_draining(state: ServerState, sig: int) -> None:
    """Turn new requests away (503) from now on, and say so: the first signal of a shutdown, under either server."""
    state.draining = True
    log.info(
        "received %s: draining %d in-flight request(s) for up to %.0fs",
        signal.Signals(sig).name,
        state.in_flight,
        state.config.drain_timeout_s,
    )


async def drain(state: ServerState) -> None:
    """Wait for in-flight requests (HTTP and gRPC) up to the drain timeout, then abort what is left.

    The caller has set ``state.draining`` already, so new requests get 503 (UNAVAILABLE).
    """
    deadline = time.monotonic() + state.config.drain_timeout_s
    # in_flight is a plain counter that HTTP and gRPC handlers move; a 50 ms poll
    # under a deadline is all draining needs.
    while state.in_flight > 0 and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    engine = state.engine
    if state.in_flight > 0 and engine is not None:
        log.warning("drain timeout: aborting %d request(s)", state.in_flight)
        engine.abort_all()
        await asyncio.sleep(0.2)
    log.info("drained; shutting down")


def build_state(server: ServerConfig, engine: EngineConfig, sessions: SessionConfig | None = None) -> ServerState:
    """A ServerState whose engine loads ``server.model`` with ``engine`` options."""

    template = check_chat_template_file(server.chat_template) if server.chat_template is not None else None
    return ServerState(
        server, lambda: AsyncEngine.for_model(server.model, engine, sessions, chat_template=template), server.served_model_name
    )


def serve(server: ServerConfig, engine: EngineConfig, sessions: SessionConfig | None = None) -> int:
    """Block serving until drained; returns the process exit code."""
    logging.basicConfig(level=server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    state = build_state(server, engine, sessions)
    app = create_app(state)
    if server.http2:
        from ember.server.serve_http2 import serve_http2

        return serve_http2(app, state)
    config = uvicorn.Config(
        app,
        host=server.host,
        port=server.port,
        log_level=server.log_level,
        access_log=False,  # Ember writes its own structured access line
        ssl_certfile=server.ssl_certfile,
        ssl_keyfile=server.ssl_keyfile,
        timeout_keep_alive=30,
        timeout_graceful_shutdown=5,
    )
    DrainingServer(config, state).run()
    return 0


def with_overrides(config: Any, **overrides: Any) -> Any:
    return replace(config, **{k: v for k, v in overrides.items() if v is not None})
