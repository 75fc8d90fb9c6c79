"""POST /v1/completions (legacy text completions)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from ember.server.generation import prepare_completion
from ember.server.protocol import CompletionRequest
from ember.server.responses import CompletionFormat, respond

router = APIRouter()


@router.post("/v1/completions", summary="Create a text completion (OpenAI-compatible)")
async def create_completion(body: CompletionRequest, http: Request) -> Response:
    return await respond(http, body, prepare_completion, CompletionFormat)
