"""What calls return: small frozen dataclasses, and readers of OpenAI chunk fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Usage:
    """Token counts the server reported (``cached_tokens``: prompt tokens served from its prefix cache)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int | None = None


@dataclass(frozen=True)
class ChatResult:
    """The complete answer of one chat or completion call.

    Times are measured from the moment the call started, so they include every
    retry and backoff: they are what the caller waited. ``ttft_s`` is None when
    the answer had no text. ``request_id`` is the response's ``X-Request-ID``
    (else the one the client sent), ``response_id`` the body's ``id``.
    """

    text: str
    finish_reason: str | None
    usage: Usage | None
    request_id: str
    response_id: str | None
    model: str | None
    ttft_s: float | None
    latency_s: float
    attempts: int
    base_url: str
    http_version: str

    @property
    def retries(self) -> int:
        """Requests made after the first one."""
        return self.attempts - 1


@dataclass(frozen=True)
class WarmupResult:
    """How warming one base URL went: ``error`` is None when every probe succeeded."""

    base_url: str
    connections: int
    elapsed_s: float
    http_version: str | None
    error: Exception | None

    @property
    def ok(self) -> bool:
        return self.error is None


def first_choice(chunk: dict[str, Any]) -> dict[str, Any] | None:
    """Choice 0 of a chunk (``n > 1`` answers are not aggregated), or None (e.g. the usage-only chunk)."""
    for choice in chunk.get("choices") or ():
        if isinstance(choice, dict) and choice.get("index", 0) == 0:
            return choice
    return None


def chunk_text(chunk: dict[str, Any]) -> str:
    """The text a chunk adds: ``delta.content`` for chat, ``text`` for completions."""
    choice = first_choice(chunk)
    if choice is None:
        return ""
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return delta.get("content") or ""
    return choice.get("text") or ""


def chunk_finish_reason(chunk: dict[str, Any]) -> str | None:
    choice = first_choice(chunk)
    return None if choice is None else choice.get("finish_reason")


def parse_usage(value: Any) -> Usage | None:
    """A ``Usage`` from an OpenAI ``usage`` object, or None when absent or malformed."""
    if not isinstance(value, dict):
        return None
    try:
        prompt_tokens = int(value.get("prompt_tokens") or 0)
        completion_tokens = int(value.get("completion_tokens") or 0)
        total_tokens = int(value.get("total_tokens") or prompt_tokens + completion_tokens)
    except (TypeError, ValueError):
        return None
    details = value.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Usage(prompt_tokens, completion_tokens, total_tokens, cached if isinstance(cached, int) else None)


def body_as_chunk(body: dict[str, Any]) -> dict[str, Any]:
    """A non-streamed response body rewritten as one stream chunk.

    Lets one reader handle servers that answer ``stream: true`` with plain JSON.
    """
    choice = first_choice(body) or {}
    message = choice.get("message")
    if isinstance(message, dict):
        new_choice = {"index": 0, "delta": {"content": message.get("content") or ""}}
    else:
        new_choice = {"index": 0, "text": choice.get("text") or ""}
    new_choice["finish_reason"] = choice.get("finish_reason")
    return {"id": body.get("id"), "model": body.get("model"), "choices": [new_choice], "usage": body.get("usage")}
