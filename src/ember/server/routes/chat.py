"""POST /v1/chat/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from ember.server.generation import Caller, admit, prepare_chat
from ember.server.protocol import ChatCompletionRequest
from ember.server.responses import ChatFormat, full_reply, streaming_reply

router = APIRouter()


@router.post("/v1/chat/completions", summary="Create a chat completion (OpenAI-compatible)")
async def create_chat_completion(body: ChatCompletionRequest, http: Request) -> Response:
    state = http.app.state.ember
    caller = Caller.from_http(http)
    prepared = prepare_chat(state, caller, body)
    prepared.record = http.scope["state"]["record"]
    await admit(state, caller, prepared)
    fmt = ChatFormat(state, prepared)
    if prepared.stream:
        return streaming_reply(state, http, prepared, fmt)
    return await full_reply(state, http, prepared, fmt)
