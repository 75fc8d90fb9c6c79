"""Which headers cross the router, and what the router reads from them on the way.

End-to-end headers pass unchanged in both directions: API keys,
``Authorization``, ``X-Request-ID``, ``X-Session-ID``, ``X-Priority``,
``X-Request-Timeout``, ``Retry-After``... Connection-scoped (hop-by-hop) ones
stop at the router (RFC 9110 section 7.6.1). All names are ASGI-style lower-case bytes.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from ember.server.request_ids import client_request_id

RawHeaders = list[tuple[bytes, bytes]]

_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
    }
)
# httpx writes Host and Content-Length for the upstream request itself.
_NOT_FORWARDED_UPSTREAM = _HOP_BY_HOP | {b"host", b"content-length"}
# uvicorn adds its own Date and Server to every response.
_NOT_FORWARDED_DOWNSTREAM = _HOP_BY_HOP | {b"date", b"server"}


@dataclass(slots=True)
class ClientHeaders:
    """A client request's headers as the router forwards and reads them."""

    forward: RawHeaders  # what goes upstream
    request_id: bytes  # the client's X-Request-ID, or one the router made up (and forwards)
    session_id: str | None  # X-Session-ID
    timeout_s: float | None  # X-Request-Timeout, when it is a number
    may_be_json: bool  # no Content-Type, or a JSON one


def read_client_headers(raw: RawHeaders) -> ClientHeaders:
    """One pass over a client's headers: what to forward, and what the router needs to know."""
    forward: RawHeaders = []
    request_id: bytes | None = None
    session_id: str | None = None
    timeout_s: float | None = None
    may_be_json = True
    has_accept_encoding = False
    for name, value in raw:
        if name in _NOT_FORWARDED_UPSTREAM:
            continue
        if name == b"x-request-id":
            # Only a reasonable token travels on, as the replica would decide (server/request_ids.py).
            value = client_request_id(value.decode("latin-1")).encode()
            request_id = value
        forward.append((name, value))
        if name == b"x-session-id":
            session_id = value.decode("latin-1") or None
        elif name == b"x-request-timeout":
            try:
                timeout_s = float(value)
            except ValueError:
                pass  # forwarded anyway: the replica answers 400 for it
        elif name == b"content-type":
            may_be_json = b"json" in value.lower()
        elif name == b"accept-encoding":
            has_accept_encoding = True
    if not has_accept_encoding:
        # Otherwise httpx asks for gzip on the client's behalf, and raw compressed
        # bytes would reach a client that never asked for them.
        forward.append((b"accept-encoding", b"identity"))
    if request_id is None:
        # One id for the router's log lines and the replica's: correlation needs no client help.
        request_id = uuid.uuid4().hex.encode()
        forward.append((b"x-request-id", request_id))
    return ClientHeaders(forward, request_id, session_id, timeout_s, may_be_json)


def upstream_response_headers(raw: RawHeaders, request_id: bytes | None = None) -> RawHeaders:
    """An upstream's response headers fit to forward; ``request_id`` is added if it has none."""
    headers: RawHeaders = []
    has_request_id = False
    for name, value in raw:
        name = name.lower()
        if name not in _NOT_FORWARDED_DOWNSTREAM:
            headers.append((name, value))
            has_request_id = has_request_id or name == b"x-request-id"
    if request_id is not None and not has_request_id:
        headers.append((b"x-request-id", request_id))
    return headers
