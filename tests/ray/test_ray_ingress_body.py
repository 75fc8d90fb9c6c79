"""The Ray ingress answers before any replica is called when the body is too large, and not at all when the client is gone.

These paths end before the ingress touches its deployment handle, so the
relay runs here as the ASGI app it is, without a Ray instance.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import MutableMapping
from typing import Any

from ember.ray.config import RayConfig
from ember.ray.ingress import SessionRelay

SCOPE = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [(b"content-type", b"application/json")]}


def run_relay(max_body_bytes: int, *messages: MutableMapping[str, Any]) -> list[MutableMapping[str, Any]]:
    """What the relay sends for a request whose body arrives as ``messages``."""
    queue, sent = list(messages), []

    async def receive() -> MutableMapping[str, Any]:
        return queue.pop(0)

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    relay = SessionRelay(None, RayConfig(), max_body_bytes)  # type: ignore[arg-type]  # no replica is reached
    asyncio.run(relay(dict(SCOPE), receive, send))
    return sent


def test_a_body_over_the_limit_is_a_413_in_openais_shape() -> None:
    sent = run_relay(8, {"type": "http.request", "body": b'{"messages": [', "more_body": True})
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 413
    error = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))["error"]
    assert error["code"] == "body_too_large" and "8 bytes" in error["message"]


def test_a_client_gone_before_its_body_ended_gets_nothing() -> None:
    assert run_relay(100, {"type": "http.request", "body": b"{", "more_body": True}, {"type": "http.disconnect"}) == []
