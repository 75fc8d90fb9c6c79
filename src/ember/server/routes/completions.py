"""POST /v1/completions (legacy text completions)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from ember.server.generation import Caller, admit, prepare_completion
from ember.server.protocol import CompletionRequest
from ember.server.responses import CompletionFormat, full_reply, streaming_reply

router = APIRouter()


@router.post("/v1/completions", summary="Create a text completion (OpenAI-compatible)")
async def create_completion(body: CompletionRequest, http: Request) -> Response:
    state = http.app.state.ember
    caller = Caller.from_http(http)
    prepared = prepare_completion(state, caller, body)
    prepared.record = http.scope["state"]["record"]
    await admit(state, caller, prepared)
    fmt = CompletionFormat(state, prepared)
    if prepared.stream:
        return streaming_reply(state, http, prepared, fmt)
    return await full_reply(state, http, prepared, fmt)
