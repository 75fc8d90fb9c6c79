"""The request pipeline in front of every route, as plain ASGI (no per-request tasks).

In order: arrival time and request id (echo ``X-Request-ID`` when it is a
reasonable token, else make one) → API key (401) → body size limit (413, also
for chunked bodies) → in-flight accounting → unhandled errors (one log
record, a 500 in OpenAI's shape) → the access log line. Written as raw ASGI
because Starlette's BaseHTTPMiddleware adds a task and a queue per request
and interferes with streaming.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from collections.abc import Mapping
from typing import Any

from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ember import webchat
from ember.server.errors import APIError
from ember.server.memory_peaks import MemoryPeaks
from ember.server.request_ids import client_request_id
from ember.server.state import ServerState

access_log = logging.getLogger("ember.access")
log = logging.getLogger("ember.server")

# Reachable without an API key: liveness, readiness and scraping (and the chat
# page, which holds no data: it asks for the key and sends it on /v1 calls).
PUBLIC_PATHS = frozenset({"/health", "/ready", "/metrics", "/docs", "/openapi.json", "/redoc"})


class _BodyTooLarge(HTTPException):
    """Raised from ``receive``; an HTTPException so frameworks pass it through as 413."""

    def __init__(self) -> None:
        super().__init__(413, "The request body is too large.")


class RequestPipeline:
    """One ASGI middleware for the whole pipeline, so the order is explicit."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state
        key = state.config.api_key
        self._api_key = key.encode() if key else None
        self._max_body = state.config.max_body_bytes
        self._memory = MemoryPeaks() if state.config.trace_memory else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        headers = _headers(scope)
        request_id = client_request_id(headers.get("x-request-id"))
        scope.setdefault("state", {})
        # The request clock starts here, before admission: see generation.Caller.
        scope["state"]["arrived"] = time.monotonic()
        scope["state"]["request_id"] = request_id
        record: dict[str, Any] = {}
        scope["state"]["record"] = record
        status_holder = [0]

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                status_holder[0] = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", request_id.encode())]
            await send(message)

        path = scope.get("path", "")
        try:
            self._authenticate(path, headers, scope)
            declared = headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > self._max_body:
                raise _BodyTooLarge
        except APIError as exc:
            await exc.response()(scope, receive, send_with_id)
            self._log(scope, request_id, status_holder[0], started, record)
            return
        except _BodyTooLarge:
            await _too_large(self._max_body)(scope, receive, send_with_id)
            self._log(scope, request_id, 413, started, record)
            return

        counting = path.startswith("/v1/")
        if counting:
            self.state.in_flight += 1
        tracked = self._memory.begin() if self._memory is not None else None
        try:
            await self.app(scope, self._limited(receive), send_with_id)
        except _BodyTooLarge:
            await _too_large(self._max_body)(scope, receive, send_with_id)
        except Exception:
            record["error"] = 500
            if status_holder[0]:
                # The reply has started and cannot become a 500: let the server
                # close the connection; it logs the traceback, once.
                raise
            # Handled here rather than by an app-level handler: Starlette re-raises
            # after calling that one, and uvicorn logged the same traceback again.
            log.exception("unhandled error on %s %s (request %s)", scope.get("method"), path, request_id)
            self.state.metrics.errors.labels(self.state.model_name, "500").inc()
            error = APIError(500, "Internal server error.", "server_error", None, "internal_error")
            await error.response()(scope, receive, send_with_id)
        finally:
            for done in scope["state"].get("on_done", ()):
                done()  # e.g. give the admission slot back, however the exchange ended
            if counting:
                self.state.in_flight -= 1
            if tracked is not None and self._memory is not None:
                record["process_peak_python_bytes"] = self._memory.end(tracked)
            self._log(scope, request_id, status_holder[0], started, record)

    def _authenticate(self, path: str, headers: dict[str, str], scope: Scope) -> None:
        if path in PUBLIC_PATHS or webchat.is_page_path(path):
            return
        namespace = authenticate(self._api_key, headers)
        if namespace is not None:
            scope["state"]["api_key_namespace"] = namespace

    def _limited(self, receive: Receive) -> Receive:
        remaining = [self._max_body]

        async def limited_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                remaining[0] -= len(message.get("body", b""))
                if remaining[0] < 0:
                    raise _BodyTooLarge
            return message

        return limited_receive

    def _log(self, scope: Scope, request_id: str, status: int, started: float, record: dict[str, Any]) -> None:
        log_access(scope.get("method"), scope.get("path"), request_id, status, started, record)


def authenticate(api_key: bytes | None, headers: Mapping[str, str]) -> str | None:
    """Check the request's key (``Authorization: Bearer`` or ``X-API-Key``); return its session namespace.

    Returns None when the server has no key. Raises a 401 ``APIError`` for a
    missing or wrong key. Shared by HTTP and gRPC (where headers are metadata).
    """
    if api_key is None:
        return None
    given = headers.get("authorization", "")
    token = given[7:].strip() if given[:7].lower() == "bearer " else headers.get("x-api-key", "")
    # Constant-time compare: response time must not reveal how much of a key matched.
    if not hmac.compare_digest(token.encode(), api_key):
        raise APIError(
            401, "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.", "authentication_error", None, "invalid_api_key"
        )
    # Session ids are namespaced by key; a digest, never the key itself.
    return hmac.new(b"ember-session", token.encode(), "sha256").hexdigest()[:16]


def log_access(method: str | None, path: str | None, request_id: str, status: int, started: float, record: dict[str, Any]) -> None:
    """Write one structured access line (``started`` is a ``time.perf_counter`` reading)."""
    if not access_log.isEnabledFor(logging.INFO):
        return
    line = {
        "request_id": request_id,
        "method": method,
        "path": path,
        "status": status,
        "total_s": round(time.perf_counter() - started, 6),
    }
    for key in (
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
        "draft_tokens",
        "accepted_draft_tokens",
        "queue_s",
        "ttft_s",
        "finish_reason",
        "max_tokens",
        "process_peak_python_bytes",
        "error",
    ):
        if key in record:
            value = record[key]
            line[key] = round(value, 6) if isinstance(value, float) else value
    access_log.info(json.dumps(line))


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


def _too_large(limit: int) -> Response:
    return APIError(413, f"The request body exceeds {limit} bytes.", "invalid_request_error", None, "request_too_large").response()
