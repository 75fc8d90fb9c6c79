"""POST /v1/chat/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from ember.server.generation import prepare_chat
from ember.server.protocol import ChatCompletionRequest
from ember.server.responses import ChatFormat, respond

router = APIRouter()


@router.post("/v1/chat/completions", summary="Create a chat completion (OpenAI-compatible)")
async def create_chat_completion(body: ChatCompletionRequest, http: Request) -> Response:
    return await respond(http, body, prepare_chat, ChatFormat)
