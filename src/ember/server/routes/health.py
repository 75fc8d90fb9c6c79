"""GET /health (alive), GET /ready (loaded and warmed up), GET /metrics (Prometheus)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from ember.server.metrics import CONTENT_TYPE

router = APIRouter()


@router.get("/health", summary="Liveness: the process answers")
async def health(http: Request) -> dict[str, Any]:
    state = http.app.state.ember
    status = "draining" if state.draining else ("ready" if state.ready else "loading")
    body: dict[str, Any] = {"status": status, "in_flight": state.in_flight}
    if state.load_error:
        body["error"] = state.load_error
    body["degraded"] = state.degrade.snapshot()
    body["admission"] = {
        "running": state.admission.running,
        "waiting": state.admission.num_waiting,
        "drain_rate_per_s": round(state.admission.drain.rate, 3),
    }
    return body


@router.get("/ready", summary="Readiness: 200 once loaded and warmed up, 503 while loading or draining")
async def ready(http: Request) -> Response:
    state = http.app.state.ember
    if state.ready and not state.draining:
        return JSONResponse({"status": "ready"})
    status = "draining" if state.draining else "loading"
    return JSONResponse({"status": status}, status_code=503, headers={"Retry-After": str(round(state.retry_after_s()))})


@router.get("/metrics", summary="Prometheus metrics")
async def metrics(http: Request) -> Response:
    return Response(http.app.state.ember.metrics.render(), media_type=CONTENT_TYPE)
