"""Which conversation a request belongs to: the key the ``session`` policy hashes.

In order of preference:

1. the ``X-Session-ID`` header;
2. the session id in the path of ``/v1/sessions/{id}[/...]`` (session management
   calls land where the session's turns land);
3. the body's ``session_id``, then its ``user``;
4. a hash of the conversation's opening: for a chat, every message up to and
   including the first user message (so later turns, which only append, keep
   the key); for a completion, the prompt's first ``prompt_chars`` characters.

Explicit ids are used as they are, so a header and a body ``session_id`` with
the same value name the same session. Hashed keys carry a ``conv:`` prefix.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

SESSIONS_PATH_PREFIX = "/v1/sessions/"
# Only these methods carry a body the key can come from.
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


class MalformedBodyError(ValueError):
    """The request body is not a JSON object (the router answers 400)."""


def parse_json_object(body: bytes) -> dict[str, Any]:
    """Decode a request body that must be a JSON object."""
    try:
        payload = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise MalformedBodyError(f"Request body is not valid JSON: {exc}") from exc
    if not isinstance(payload, dict):
        raise MalformedBodyError("Request body must be a JSON object.")
    return payload


def request_key(session_header: str | None, path: str, method: str, body: bytes, *, may_be_json: bool, prompt_chars: int) -> str | None:
    """The session key of one request, in the order the module docstring gives.

    The body is parsed only when neither the ``X-Session-ID`` header nor the
    path names the session. Raises ``MalformedBodyError`` for a JSON body that
    is not a JSON object.
    """
    key = session_header or key_from_path(path)
    if key is None and body and may_be_json and method in BODY_METHODS:
        key = key_from_body(parse_json_object(body), prompt_chars)
    return key


def key_from_path(path: str) -> str | None:
    """The session id of a ``/v1/sessions/{id}`` path, else None."""
    if not path.startswith(SESSIONS_PATH_PREFIX):
        return None
    session_id = path[len(SESSIONS_PATH_PREFIX) :].split("/", 1)[0]
    return session_id or None


def key_from_body(payload: dict[str, Any], prompt_chars: int) -> str | None:
    """The session key carried by, or derived from, a request body."""
    for field in ("session_id", "user"):
        value = payload.get(field)
        if isinstance(value, str) and value:
            return value
    messages = payload.get("messages")
    if isinstance(messages, list) and messages:
        return _hash_key(_conversation_opening(messages))
    prompt = payload.get("prompt")
    if isinstance(prompt, str) and prompt:
        return _hash_key(prompt[:prompt_chars])
    if isinstance(prompt, list) and prompt:
        # Token ids or a batch: the JSON text of a growing list keeps its prefix.
        return _hash_key(json.dumps(prompt)[:prompt_chars])
    return None


def _conversation_opening(messages: list[Any]) -> str:
    opening: list[Any] = []
    for message in messages:
        if not isinstance(message, dict):
            opening.append(message)
            continue
        opening.append([message.get("role"), message.get("content")])
        if message.get("role") == "user":
            break
    return json.dumps(opening, ensure_ascii=False, sort_keys=True, separators=(",", ":"))


def _hash_key(text: str) -> str:
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=12).hexdigest()
    return f"conv:{digest}"
