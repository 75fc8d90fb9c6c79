"""The router's own error answers, in the OpenAI shape.

Every error the router itself produces is ``{"error": {"message", "type",
"param", "code"}}``: as a JSON response before anything was sent, or as one
last SSE event followed by ``data: [DONE]`` when a stream breaks midway.
Errors an upstream produced are passed through unchanged.
"""

from __future__ import annotations

import json

from starlette.responses import JSONResponse

# OpenAI error types used by the router.
INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
NOT_FOUND = "not_found_error"
SERVER_ERROR = "server_error"


def error_body(message: str, type: str, code: str | None = None, param: str | None = None) -> dict[str, object]:
    """The OpenAI error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    *,
    type: str,
    code: str | None = None,
    param: str | None = None,
    retry_after_s: int | None = None,
) -> JSONResponse:
    """A JSON error response; ``retry_after_s`` adds a ``Retry-After`` header."""
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return JSONResponse(error_body(message, type, code, param), status_code=status, headers=headers)


def sse_error_events(message: str, code: str) -> bytes:
    """The clean end of a broken stream: an error event, then ``[DONE]``.

    The official OpenAI client raises an ``APIError`` with this message when it
    reads the error event, instead of hanging or failing to parse.
    """
    payload = json.dumps(error_body(message, SERVER_ERROR, code), separators=(",", ":"))
    return f"data: {payload}\n\ndata: [DONE]\n\n".encode()
