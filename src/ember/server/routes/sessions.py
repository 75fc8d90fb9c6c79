"""GET /v1/sessions, GET and DELETE /v1/sessions/{id}: the conversation tiers.

With an API key, a caller sees and deletes only the sessions of its own key:
ids are namespaced per key (see ``generation._session_id``) and the namespace
is stripped before ids are shown.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from ember.engine.api import AsyncEngine
from ember.server.errors import APIError
from ember.server.generation import engine_or_503

router = APIRouter()


def _namespace(http: Request) -> str:
    ns = http.scope.get("state", {}).get("api_key_namespace")
    return f"{ns}:" if ns else ""


def _public(info: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {**info, "id": str(info["id"])[len(prefix) :], "object": "session"}


def _engine(http: Request) -> AsyncEngine:
    engine = engine_or_503(http.app.state.ember)
    if not engine.info.sessions_enabled:
        raise APIError(
            404, "Session tiers are disabled on this server (--no-sessions).", "invalid_request_error", None, "sessions_disabled"
        )
    return engine


@router.get("/v1/sessions", summary="List conversations and the tier their KV state is in")
async def list_sessions(http: Request) -> dict[str, Any]:
    engine = _engine(http)
    prefix = _namespace(http)
    rows = await engine.list_sessions(prefix) or []
    return {"object": "list", "data": [_public(r, prefix) for r in rows]}


@router.get("/v1/sessions/{session_id}", summary="One conversation's tier, size and expiry")
async def get_session(session_id: str, http: Request) -> dict[str, Any]:
    engine = _engine(http)
    prefix = _namespace(http)
    info = await engine.get_session(prefix + session_id)
    if info is None:
        raise APIError(404, f"No session '{session_id}'.", "invalid_request_error", "session_id", "session_not_found")
    return _public(info, prefix)


@router.delete("/v1/sessions/{session_id}", summary="Forget a conversation's KV state in every tier")
async def delete_session(session_id: str, http: Request) -> dict[str, Any]:
    engine = _engine(http)
    key = _namespace(http) + session_id
    deleted = await engine.delete_session(key)
    if not deleted:
        raise APIError(404, f"No session '{session_id}'.", "invalid_request_error", "session_id", "session_not_found")
    return {"id": session_id, "object": "session", "deleted": True}
