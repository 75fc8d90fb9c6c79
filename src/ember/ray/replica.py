"""EmberReplica: one Ray Serve replica, one Ember engine, the ``ember serve`` app.

The replica builds the same state and app as ``ember serve`` (``build_state``,
``create_app``): the OpenAI API, SSE streaming, session tiers, admission
control, degradation and metrics are that app's. Ray Serve does not speak HTTP
to it; the ingress sends each request as an ``HttpExchange`` and the replica
runs it through the app in process (``exchange.run_asgi``).

Life of a replica: the constructor loads and warms up the model (Ray routes
nothing to a replica before its constructor returns, so no client sees it
loading) → serving → on scale-down or redeploy Ray stops routing to it, waits
for its in-flight requests (``graceful_shutdown_timeout_s``, the server's
drain timeout) and calls ``__del__``, which persists hot conversations to the
``--session-dir`` and stops the engine. A replica that dies without warning
leaves its conversations' write-behind copies in that directory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from ember.client.sse import SSEDecoder
from ember.config import EngineConfig, ServerConfig, SessionConfig
from ember.ray.autoscale import IN_FLIGHT, TTFT_P99_S, WAITING
from ember.ray.config import RayConfig
from ember.ray.exchange import HttpExchange, Message, run_asgi
from ember.server.app import create_app
from ember.server.serve import build_state, drain

log = logging.getLogger("ember.ray")

# Response header naming the Ray replica that served the request (its Ray replica id).
REPLICA_HEADER = b"x-ember-replica"


class EmberAPIError(Exception):
    """An error answer to a Ray-native call: the HTTP status and the OpenAI error body."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(status, body)
        self.status = status
        self.body = body

    def __str__(self) -> str:
        message = self.body.get("error", {}).get("message") if isinstance(self.body.get("error"), dict) else None
        return f"{self.status}: {message or self.body}"


@serve.deployment(name="EmberReplica")
class EmberReplica:
    """A Ray Serve deployment: every replica owns one engine (see module docstring)."""

    # Ray Serve awaits an async constructor: the engine loads before the replica takes requests.
    async def __init__(self, server: ServerConfig, engine: EngineConfig, sessions: SessionConfig, ray_config: RayConfig) -> None:  # type: ignore[misc]
        logging.basicConfig(level=server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self._extra_headers = [(REPLICA_HEADER, self.replica_id.encode("latin-1"))]
        self.metrics_url: str | None = None
        self._metrics_server: Any = None
        self.state = build_state(server, engine, sessions)
        self.app = create_app(self.state)
        self._lifespan = contextlib.AsyncExitStack()
        await self._lifespan.enter_async_context(self.app.router.lifespan_context(self.app))
        await self.app.state.loading_task
        if not self.state.ready:
            raise RuntimeError(f"the model failed to load: {self.state.load_error}")
        if ray_config.metrics_port:
            self._serve_metrics(server.host, ray_config.metrics_port + context.rank.local_rank)
        log.info("replica %s ready (pid %d, metrics %s)", self.replica_id, os.getpid(), self.metrics_url or "via the app")

    def _serve_metrics(self, host: str, port: int) -> None:
        from prometheus_client import start_http_server

        try:
            self._metrics_server, _ = start_http_server(port, addr=host, registry=self.state.metrics.registry)
        except OSError as exc:
            log.warning("replica %s: cannot serve metrics on %s:%d: %s", self.replica_id, host, port, exc)
            return
        self.metrics_url = f"http://{host}:{port}/metrics"

    # -- called by the ingress ----------------------------------------------------------------

    async def handle_http(self, exchange: HttpExchange) -> AsyncIterator[list[Message]]:
        """The app's ASGI messages for one HTTP request, in batches (call with ``stream=True``)."""
        async for batch in run_asgi(self.app, exchange, self._extra_headers):
            yield batch

    # -- the Ray-native API -------------------------------------------------------------------

    async def chat(self, body: dict[str, Any], headers: dict[str, str] | None = None) -> AsyncIterator[dict[str, Any]]:
        """``POST /v1/chat/completions`` for Ray-native callers; call with ``stream=True``.

        Yields the stream's chunks as dicts (the ``usage`` chunk included) when
        ``body`` asks to stream, else the one completion object. An error answer
        raises ``EmberAPIError``. ``headers`` are HTTP request headers
        (``Authorization`` with ``--api-key``, ``X-Priority`` ...).
        """
        async for item in self._openai("/v1/chat/completions", body, headers):
            yield item

    async def completions(self, body: dict[str, Any], headers: dict[str, str] | None = None) -> AsyncIterator[dict[str, Any]]:
        """``POST /v1/completions`` for Ray-native callers, as ``chat``."""
        async for item in self._openai("/v1/completions", body, headers):
            yield item

    async def _openai(self, path: str, body: dict[str, Any], headers: dict[str, str] | None) -> AsyncIterator[dict[str, Any]]:
        raw_headers = [(b"content-type", b"application/json")]
        raw_headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
        exchange = HttpExchange("POST", path, headers=tuple(raw_headers), body=json.dumps(body).encode())
        status = 0
        is_sse = False
        content = bytearray()
        decoder = SSEDecoder()
        async for batch in run_asgi(self.app, exchange):
            for message in batch:
                if message["type"] == "http.response.start":
                    status = message["status"]
                    is_sse = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in message["headers"])
                    continue
                chunk = message.get("body", b"")
                if not (is_sse and status == 200):
                    content += chunk
                    continue
                for event in decoder.feed(chunk):
                    if event.data == "[DONE]":
                        return
                    item = json.loads(event.data)
                    if "error" in item:
                        raise EmberAPIError(500, item)
                    yield item
        parsed = json.loads(content) if content else {}
        if status != 200:
            raise EmberAPIError(status, parsed)
        yield parsed

    async def replica_info(self) -> dict[str, Any]:
        """Which replica this is: its Ray replica id, process id and per-replica metrics URL."""
        return {"replica_id": self.replica_id, "pid": os.getpid(), "metrics_url": self.metrics_url}

    # -- Ray Serve's hooks --------------------------------------------------------------------

    def check_health(self) -> None:
        """Ray Serve restarts a replica whose engine stopped."""
        engine = self.state.engine
        if not self.state.ready or engine is None or not engine.is_running:
            raise RuntimeError(f"replica {self.replica_id}: the engine is not running")

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Ember's own load signals for ``ember.ray.autoscale``."""
        ttft = self.state.degrade.snapshot()["p99_ttft_s"]
        return {
            IN_FLIGHT: float(self.state.in_flight),
            WAITING: float(self.state.admission.num_waiting),
            TTFT_P99_S: float(ttft or 0.0),
        }

    async def __del__(self) -> None:
        """Ray has drained this replica: finish what is left, persist hot conversations, stop the engine."""
        self.state.draining = True
        await drain(self.state)
        await self._lifespan.aclose()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
