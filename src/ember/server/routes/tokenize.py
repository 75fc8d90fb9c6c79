"""POST /tokenize and /detokenize: the served model's tokenizer, as vLLM's server offers it.

``/tokenize`` takes a ``prompt`` (text, tokenized as /v1/completions does) or
chat ``messages`` (rendered with the chat template and tools as
/v1/chat/completions does, so the count is what a chat request costs).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ember.server.errors import bad_request
from ember.server.generation import engine_or_503
from ember.server.protocol import ChatMessage, TextBody, Tool
from ember.server.tools import ToolSpec, render_messages

router = APIRouter()

# Ids per /detokenize call; a longer list is a 400 rather than a long decode on the event loop.
MAX_DETOKENIZE_TOKENS = 131_072


class TokenizeRequest(TextBody):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    # For a prompt: add the model's BOS token as /v1/completions does.
    add_special_tokens: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of 'prompt' or 'messages'")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: Annotated[list[int], Field(max_length=MAX_DETOKENIZE_TOKENS)]


@router.post("/tokenize", summary="Token ids of a prompt or of chat messages")
async def tokenize(body: TokenizeRequest, http: Request) -> dict[str, Any]:
    engine = engine_or_503(http.app.state.ember)
    tokenizer = engine.tokenizer
    if body.messages is not None:
        spec = (
            ToolSpec("auto", tuple(t.function for t in body.tools), offered=tuple(t.function for t in body.tools))
            if body.tools
            else ToolSpec("none")
        )
        rows, template_tools = render_messages(body.messages, spec, tokenizer.template_renders_tools)
        try:
            ids = tokenizer.encode_rendered(tokenizer.render_chat(rows, body.add_generation_prompt, tools=template_tools))
        except ValueError as exc:
            raise bad_request(str(exc), "messages") from None
    else:
        ids = tokenizer.encode(body.prompt or "", add_bos=None if body.add_special_tokens else False)
    reply: dict[str, Any] = {"count": len(ids), "max_model_len": engine.info.max_model_len, "tokens": ids}
    if body.return_token_strs:
        reply["token_strs"] = [tokenizer.id_to_token(i) for i in ids]
    return reply


@router.post("/detokenize", summary="The text of token ids")
async def detokenize(body: DetokenizeRequest, http: Request) -> dict[str, Any]:
    engine = engine_or_503(http.app.state.ember)
    vocab = engine.info.vocab_size
    bad = next((i for i, t in enumerate(body.tokens) if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"Token ids must be in [0, {vocab}); tokens[{bad}] is {body.tokens[bad]}.", f"tokens.{bad}")
    return {"prompt": engine.tokenizer.decode(body.tokens, skip_special_tokens=False)}
