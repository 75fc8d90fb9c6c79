"""OpenAI wire format: request bodies (pydantic) and response objects (plain dicts).

Requests are validated with pydantic and turned into engine ``SamplingParams``.
Fields that are not OpenAI's are ignored, as OpenAI's API does; OpenAI fields
Ember does not implement are kept (``extra="allow"``) so that
``server/unsupported.py`` can refuse them by name. Responses are built as dicts
because they are serialised once per chunk on the hot path, where a pydantic
round trip would cost more than the framing itself.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ember.engine.api import FinishReason, Priority, TokenLogprob

Role = Literal["system", "developer", "user", "assistant", "tool"]

# UTF-16 surrogates are not characters. JSON may spell one (``"\ud800"``); a
# correctly paired escape decodes to its character, so any surrogate left in
# a decoded string is lone or misordered, and no tokenizer can take it.
_SURROGATE = re.compile("[\ud800-\udfff]")
SURROGATE_ERROR = "lone_surrogate"


def find_surrogate(value: Any, path: tuple[str, ...] = ()) -> tuple[str, ...] | None:
    """The path of the first string (value or key) in a decoded JSON value holding a surrogate, or None."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if not item.isascii() and _SURROGATE.search(item):
                return where
        elif isinstance(item, dict):
            for key, child in item.items():
                if isinstance(key, str) and not key.isascii() and _SURROGATE.search(key):
                    return where
                stack.append((child, (*where, str(key))))
        elif isinstance(item, list):
            stack.extend((child, (*where, str(i))) for i, child in enumerate(item))
    return None


class TextBody(BaseModel):
    """A request body whose every string is text: checked once, on the decoded JSON, before any field.

    Every text field of every request (message contents and parts, names,
    tool descriptions and schemas, stop strings, prompts, fields Ember
    ignores...) passes here, whatever the route; a surrogate is a 400 naming
    the field (``ctx["param"]``), never a tokenizer crash.
    """

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        where = find_surrogate(data)
        if where is not None:
            param = ".".join(where) or None
            raise PydanticCustomError(
                SURROGATE_ERROR,
                "contains a UTF-16 surrogate code point that is not part of a valid pair (not valid Unicode text)",
                {"param": param},
            )
        return data


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


def text_of(content: str | list[TextPart] | None) -> str:
    """A content field's text: the string, or its text parts joined (nothing for None)."""
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(part.text for part in content)


# -- structured outputs and tools ----------------------------------------------


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = Field(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    # "schema" would shadow a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    # Ember always enforces the schema; strict is accepted either way.
    strict: bool | None = None


class ResponseFormatText(BaseModel):
    type: Literal["text"]


class ResponseFormatJsonObject(BaseModel):
    type: Literal["json_object"]


class ResponseFormatJsonSchema(BaseModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema, Field(discriminator="type")]


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    # A JSON schema for the arguments object; omitted means no arguments.
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: ToolChoiceFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str  # JSON text, as the model wrote it


class MessageToolCall(BaseModel):
    """A tool call in an assistant message of the history."""

    model_config = ConfigDict(extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


# -- messages ---------------------------------------------------------------------


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Role
    # A string or a list of text parts; images and audio are refused with a clear 400.
    content: str | list[TextPart] | None = None
    name: str | None = None
    # Assistant messages: the calls the model made. Tool messages: which call this answers.
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        return text_of(self.content)


class Prediction(BaseModel):
    """OpenAI's Predicted Outputs: text the answer is expected to repeat (a file being edited, say).

    Ember drafts from it (engine/speculation.py); the answer is the one the
    request gets without it, only sooner where the model agrees with it.
    """

    model_config = ConfigDict(extra="ignore")
    type: Literal["content"]
    content: str | list[TextPart]

    def text(self) -> str:
        return text_of(self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


PriorityName = Literal["high", "normal", "low"]


class _GenerationFields(TextBody):
    """Fields shared by /chat/completions and /completions."""

    model_config = ConfigDict(extra="allow")

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
    # Token id (as a string, OpenAI's JSON shape) -> bias in [-100, 100].
    logit_bias: dict[str, float] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isdigit():
                raise ValueError(f"keys must be token ids, got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"values must be between -100 and 100, got {bias} for token {key}")
        return value

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
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    prediction: Prediction | None = None


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


def usage(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    cache_tier: str,
    accepted_prediction: int = 0,
    rejected_prediction: int = 0,
) -> dict[str, Any]:
    """OpenAI's ``usage`` object, plus Ember's ``prompt_tokens_details.cache_tier``.

    ``cache_tier`` says where most of the cached prompt tokens came from: ``hot``
    (KV blocks still in the pool), ``warm`` (restored from the warm tier in
    RAM), ``disk`` (restored from the warm tier's files) or ``cold`` (nothing
    reused, the prompt was computed). It is known only once
    the request is scheduled, so it travels here, in the last chunk, rather than
    in a response header. OpenAI clients keep unknown fields of
    ``prompt_tokens_details`` (``usage.prompt_tokens_details.cache_tier``).
    ``completion_tokens_details`` counts a ``prediction``'s tokens that the
    answer took and those it did not, as OpenAI does (zeros without one).
    """
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens, "cache_tier": cache_tier},
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "accepted_prediction_tokens": accepted_prediction,
            "rejected_prediction_tokens": rejected_prediction,
        },
    }


def chat_logprobs(entries: list[TokenLogprob], token_text: Any) -> dict[str, Any]:
    """OpenAI ``choice.logprobs`` for chat: content list with top alternatives."""

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]}
