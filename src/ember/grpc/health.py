"""The standard gRPC health service (``grpc.health.v1.Health``), tied to the server's readiness.

SERVING exactly when HTTP ``/ready`` answers 200: the model is loaded and
warmed up, and the server is not draining. Otherwise NOT_SERVING (also
before the model loaded, since the gRPC port opens first). It answers for
the whole server (``""``) and for ``ember.v1.Generation``.

``Check`` reads the state at the moment of the call; ``Watch`` streams follow
a poll of the state every ``period_s``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from ember.server.state import ServerState

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class ReadinessHealth(health_aio.HealthServicer):
    """A health servicer whose statuses follow ``ServerState`` (ready and not draining)."""

    def __init__(self, state: ServerState, services: tuple[str, ...]) -> None:
        super().__init__()
        self.state = state
        self.services = ("", *services)
        self._current: int | None = None

    def serving_status(self) -> int:
        """SERVING when the server would answer /ready with 200."""
        return SERVING if self.state.ready and not self.state.draining else NOT_SERVING

    async def sync(self) -> None:
        """Publish the current status (wakes ``Watch`` streams when it changed)."""
        status = self.serving_status()
        if status != self._current:
            self._current = status
            for service in self.services:
                await self.set(service, status)

    async def Check(self, request: Any, context: Any) -> Any:
        await self.sync()
        return await super().Check(request, context)

    async def follow(self, period_s: float = 0.1) -> None:
        """Keep the published status in step with the state (runs until cancelled)."""
        while True:
            await self.sync()
            await asyncio.sleep(period_s)
