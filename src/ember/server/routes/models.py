"""GET /v1/models and /v1/models/{id}."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from ember.server.errors import APIError

router = APIRouter()


def _model_card(state: Any) -> dict[str, Any]:
    card: dict[str, Any] = {"id": state.model_name, "object": "model", "created": int(state.started_at), "owned_by": "ember"}
    if state.engine is not None:
        card["max_model_len"] = state.engine.info.max_model_len
    # What a request gets for the sampling fields it leaves out, and where each value comes from.
    card["generation_defaults"] = state.defaults.card()
    return card


@router.get("/v1/models", summary="List the served model")
async def list_models(http: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(http.app.state.ember)]}


@router.get("/v1/models/{model_id}", summary="Describe the served model")
async def get_model(model_id: str, http: Request) -> dict[str, Any]:
    state = http.app.state.ember
    if model_id != state.model_name:
        raise APIError(404, f"The model '{model_id}' does not exist.", "invalid_request_error", "model", "model_not_found")
    return _model_card(state)
