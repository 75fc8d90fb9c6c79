"""Server-sent events framing: the only place that knows the SSE wire format."""

from __future__ import annotations

import json
from typing import Any

DONE = b"data: [DONE]\n\n"

# Streaming response headers. ``Connection`` is HTTP/1-only (HTTP/2 forbids
# connection-specific headers), see ``headers_for``.
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def headers_for(http_version: str) -> dict[str, str]:
    if http_version.startswith("1"):
        return {**STREAM_HEADERS, "Connection": "keep-alive"}
    return dict(STREAM_HEADERS)


def event(payload: dict[str, Any]) -> bytes:
    """One ``data:`` event. Compact JSON; non-ASCII text is sent as UTF-8."""
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def error_event(body: dict[str, Any]) -> bytes:
    """An error after the stream started: an ``{"error": ...}`` event (then ``DONE``)."""
    return event(body)
