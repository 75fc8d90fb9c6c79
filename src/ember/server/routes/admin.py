"""Admin endpoints: force the degradation controller on, off, or back to automatic.

Behind the API key when one is set; without a key, only loopback clients may call them.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel

from ember.server.errors import APIError

router = APIRouter()


class DegradeCommand(BaseModel):
    mode: Literal["on", "off", "auto"]


def _check_admin(http: Request) -> None:
    if http.app.state.ember.config.api_key:
        return  # the pipeline already checked the key
    client = http.client.host if http.client else ""
    if client not in ("127.0.0.1", "::1", "localhost"):
        raise APIError(403, "Admin endpoints need --api-key when called from another host.", "permission_error", None, "forbidden")


@router.get("/admin/degrade", summary="The degradation controller's state")
async def get_degrade(http: Request) -> dict[str, Any]:
    _check_admin(http)
    return http.app.state.ember.degrade.snapshot()


@router.post("/admin/degrade", summary="Force degraded mode on or off, or return to automatic")
async def set_degrade(command: DegradeCommand, http: Request) -> dict[str, Any]:
    _check_admin(http)
    state = http.app.state.ember
    state.degrade.force({"on": True, "off": False, "auto": None}[command.mode])
    return state.degrade.snapshot()
