"""Between ``ember.v1`` protobuf messages and the OpenAI JSON shapes.

The server turns a request message into the same JSON body an HTTP client
would send, so the same pydantic models and ``prepare_*`` functions validate
it (one set of rules, one set of error messages). The client turns its
OpenAI-style body into a request message, and each reply message into the
chunk dict its stream reader already understands. Every field mapping lives
here, once for each direction. (No engine imports: the client SDK uses this
module and must not pull in torch.)
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

from ember.grpc.api import pb

PRIORITY_NAMES: dict[int, str] = {pb.PRIORITY_HIGH: "high", pb.PRIORITY_NORMAL: "normal", pb.PRIORITY_LOW: "low"}
PRIORITY_VALUES: dict[str, int] = {name: value for value, name in PRIORITY_NAMES.items()}

# SamplingOptions fields that are `optional` in the proto: unset means "the server's default".
OPTIONAL_SAMPLING = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)

# (finish_reason, stop_reason) as the HTTP API reports them; a timeout reads "length" + "timeout".
FINISH_FIELDS: dict[int, tuple[str, str | None]] = {
    pb.FINISH_REASON_STOP: ("stop", None),
    pb.FINISH_REASON_LENGTH: ("length", None),
    pb.FINISH_REASON_TIMEOUT: ("length", "timeout"),
}


# ---------------------------------------------------------------------------
# Server side: request message -> JSON body; engine output -> reply fields
# ---------------------------------------------------------------------------


def chat_body(request: Any) -> dict[str, Any]:
    """The ``/v1/chat/completions`` body equivalent to a ``ChatRequest``."""
    body = _common_body(request)
    body["messages"] = [_message_dict(m) for m in request.messages]
    return body


def completion_body(request: Any) -> dict[str, Any]:
    """The ``/v1/completions`` body equivalent to a ``CompleteRequest``."""
    body = _common_body(request)
    body["prompt"] = request.prompt
    return body


def _common_body(request: Any) -> dict[str, Any]:
    options = request.sampling
    body: dict[str, Any] = {name: getattr(options, name) for name in OPTIONAL_SAMPLING if options.HasField(name)}
    if options.stop:
        body["stop"] = list(options.stop)
    if options.ignore_eos:
        body["ignore_eos"] = True
    if options.min_tokens:
        body["min_tokens"] = options.min_tokens
    if request.model:
        body["model"] = request.model
    if request.session_id:
        body["session_id"] = request.session_id
    if request.priority != pb.PRIORITY_UNSPECIFIED:
        # An unknown enum number stays a number, so validation rejects it (INVALID_ARGUMENT).
        body["priority"] = PRIORITY_NAMES.get(request.priority, request.priority)
    return body


def _message_dict(message: Any) -> dict[str, Any]:
    item: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.name:
        item["name"] = message.name
    return item


# The engine's FinishReason values (a str enum); "abort" is an error status instead (server.py).
_ENGINE_FINISH = {
    "stop": pb.FINISH_REASON_STOP,
    "stop_string": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "timeout": pb.FINISH_REASON_TIMEOUT,
}


def finish_reason(reason: str | None) -> pb.FinishReason:
    """The proto enum for an engine finish reason (``FinishReason`` or its value)."""
    # An enum member hashes by its name, not its value: look up the value.
    key = reason.value if isinstance(reason, enum.Enum) else reason
    return _ENGINE_FINISH.get(key, pb.FINISH_REASON_UNSPECIFIED) if key is not None else pb.FINISH_REASON_UNSPECIFIED


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, max_tokens: int) -> Any:
    return pb.Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        cached_tokens=cached_tokens,
        max_tokens=max_tokens,
    )


# ---------------------------------------------------------------------------
# Client side: JSON body -> request message; reply message -> chunk dict
# ---------------------------------------------------------------------------

# Body keys the HTTP transport sends that mean nothing here: gRPC chooses streaming by
# method, and usage always comes with the last chunk.
_TRANSPORT_KEYS = frozenset({"stream", "stream_options"})


def chat_request(body: Mapping[str, Any]) -> Any:
    """A ``ChatRequest`` from an OpenAI chat body; ``ValueError`` names any field gRPC cannot carry."""
    fields = dict(body)
    messages = fields.pop("messages", None)
    if not isinstance(messages, list):
        raise ValueError("a chat needs 'messages', a list of {'role', 'content'} mappings")
    request = pb.ChatRequest(messages=[_message(m) for m in messages])
    _fill_common(request, fields)
    return request


def complete_request(body: Mapping[str, Any]) -> Any:
    """A ``CompleteRequest`` from an OpenAI completions body with a text prompt."""
    fields = dict(body)
    prompt = fields.pop("prompt", None)
    if not isinstance(prompt, str):
        raise ValueError("gRPC Complete takes a text 'prompt' (a string)")
    request = pb.CompleteRequest(prompt=prompt)
    _fill_common(request, fields)
    return request


def _message(message: Mapping[str, Any]) -> Any:
    content = message.get("content")
    if isinstance(content, list):  # text parts
        content = "".join(str(part.get("text", "")) for part in content if isinstance(part, Mapping))
    return pb.Message(role=str(message.get("role", "")), content=content or "", name=str(message.get("name") or ""))


def _fill_common(request: Any, fields: dict[str, Any]) -> None:
    for key in _TRANSPORT_KEYS:
        fields.pop(key, None)
    if fields.get("n") in (None, 1):
        fields.pop("n", None)
    model = fields.pop("model", None)
    if model:
        request.model = str(model)
    session = fields.pop("session_id", None) or fields.pop("user", None)
    fields.pop("user", None)
    if session:
        request.session_id = str(session)
    priority = fields.pop("priority", None)
    if priority is not None:
        if str(priority).lower() not in PRIORITY_VALUES:
            raise ValueError(f"priority must be one of {sorted(PRIORITY_VALUES)}, got {priority!r}")
        request.priority = PRIORITY_VALUES[str(priority).lower()]
    if "max_completion_tokens" in fields:
        fields["max_tokens"] = fields.pop("max_completion_tokens")
    options = request.sampling
    for name in OPTIONAL_SAMPLING:
        value = fields.pop(name, None)
        if value is not None:
            setattr(options, name, value)
    stop = fields.pop("stop", None)
    if stop:
        options.stop.extend([stop] if isinstance(stop, str) else list(stop))
    options.ignore_eos = bool(fields.pop("ignore_eos", False))
    options.min_tokens = int(fields.pop("min_tokens", 0) or 0)
    if fields:
        raise ValueError(f"not supported over gRPC: {', '.join(sorted(fields))} (see ember/v1/generation.proto)")


def chat_chunk_dict(chunk: Any) -> dict[str, Any]:
    """A ``ChatChunk`` as an OpenAI ``chat.completion.chunk`` dict."""
    choice: dict[str, Any] = {"index": 0, "delta": {"content": chunk.text} if chunk.text else {}}
    _put_finish(choice, chunk.finish_reason, chunk.stop_reason)
    out: dict[str, Any] = {"id": chunk.id or None, "model": chunk.model or None, "choices": [choice]}
    if chunk.HasField("usage"):
        out["usage"] = usage_dict(chunk.usage)
    return out


def completion_dict(response: Any) -> dict[str, Any]:
    """A ``CompleteResponse`` as one OpenAI ``text_completion`` chunk dict."""
    choice: dict[str, Any] = {"index": 0, "text": response.text}
    _put_finish(choice, response.finish_reason, response.stop_reason)
    out: dict[str, Any] = {"id": response.id or None, "model": response.model or None, "choices": [choice]}
    if response.HasField("usage"):
        out["usage"] = usage_dict(response.usage)
    return out


def _put_finish(choice: dict[str, Any], reason: int, stop_reason: str) -> None:
    name, implied_stop = FINISH_FIELDS.get(reason, (None, None))
    choice["finish_reason"] = name
    if name is not None:
        choice["stop_reason"] = stop_reason or implied_stop


def usage_dict(message: Any) -> dict[str, Any]:
    """A ``Usage`` message as OpenAI's ``usage`` object (plus Ember's ``max_tokens``)."""
    return {
        "prompt_tokens": message.prompt_tokens,
        "completion_tokens": message.completion_tokens,
        "total_tokens": message.total_tokens,
        "prompt_tokens_details": {"cached_tokens": message.cached_tokens},
        "max_tokens": message.max_tokens,
    }
