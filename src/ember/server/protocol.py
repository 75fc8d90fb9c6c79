"""OpenAI wire format: request bodies (pydantic) and response objects (plain dicts).

Requests are validated with pydantic and turned into engine ``SamplingParams``;
unknown fields are ignored, as OpenAI's API does. Responses are built as dicts
because they are serialised once per chunk on the hot path, where a pydantic
round trip would cost more than the framing itself.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ember.engine.request import FinishReason, Priority, TokenLogprob

Role = Literal["system", "developer", "user", "assistant", "tool"]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Role
    # A string or a list of text parts; images and audio are refused with a clear 400.
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


PriorityName = Literal["high", "normal", "low"]


class _GenerationFields(BaseModel):
    """Fields shared by /chat/completions and /completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    user: str | None = Field(default=None, max_length=256)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Ember extensions (ARCHITECTURE.md).
    session_id: str | None = Field(default=None, max_length=256)
    timeout: float | None = Field(default=None, gt=0.0, le=3600.0)
    priority: PriorityName | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, ge=0.01, le=2.0)

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        return [value] if isinstance(value, str) else value


class ChatCompletionRequest(_GenerationFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


class CompletionRequest(_GenerationFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False


def parse_priority(body_value: str | None, header_value: str | None) -> int:
    """``priority`` from the body, else ``X-Priority``; unknown header values mean normal."""
    value = (body_value or header_value or "normal").strip().lower()
    return {"high": Priority.HIGH, "normal": Priority.NORMAL, "low": Priority.LOW}.get(value, Priority.NORMAL)


# ---------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now_s() -> int:
    return int(time.time())


def finish_fields(reason: FinishReason | None, stop_reason: str | int | None) -> dict[str, Any]:
    """``finish_reason`` and ``stop_reason`` as OpenAI clients expect them.

    A deadline reads ``finish_reason="length"`` (the answer was cut, as with
    max_tokens) with ``stop_reason="timeout"`` beside it, so unmodified OpenAI
    clients parse it while Ember-aware ones can tell the cause.
    """
    if reason is None:
        return {"finish_reason": None}
    if reason == FinishReason.TIMEOUT:
        return {"finish_reason": "length", "stop_reason": "timeout"}
    return {"finish_reason": reason.openai, "stop_reason": stop_reason}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def chat_logprobs(entries: list[TokenLogprob], token_text: Any) -> dict[str, Any]:
    """OpenAI ``choice.logprobs`` for chat: content list with top alternatives."""

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries
        ]
    }
