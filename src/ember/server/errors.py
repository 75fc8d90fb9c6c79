"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}``.

Every failure the server reports goes through ``APIError`` so the body shape
and the status code come from one place. Client mistakes are 4xx, always.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError
from starlette.responses import Response

from ember.errors import ContextLengthExceededError, InvalidSamplingParamsError


class APIError(Exception):
    """An error reply: status, OpenAI error fields, optional headers (Retry-After...)."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return Response(json.dumps(self.body()).encode(), status_code=self.status, headers=self.headers, media_type="application/json")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def unavailable(message: str, retry_after_s: float, code: str = "service_unavailable") -> APIError:
    return APIError(503, message, "service_unavailable", None, code, {"Retry-After": str(max(1, round(retry_after_s)))})


def error_param(error: Mapping[str, Any]) -> str | None:
    """The request field one pydantic error is about, dotted (``messages.0.content``).

    A check on the whole body (no surrogates anywhere) names its field in
    ``ctx["param"]``; otherwise it is the error's location, less FastAPI's
    leading ``body``.
    """
    ctx = error.get("ctx") or {}
    if ctx.get("param"):
        return str(ctx["param"])
    return ".".join(str(p) for p in error.get("loc", ()) if p != "body") or None


def from_validation_error(exc: ValidationError) -> APIError:
    """The first pydantic error as a 400 naming the offending field."""
    first = exc.errors(include_url=False)[0]
    param = error_param(first)
    message = first.get("msg", "Invalid request body.")
    return bad_request(f"Invalid value for '{param}': {message}" if param else message, param, "invalid_value")


def from_engine_error(exc: Exception) -> APIError | None:
    """Map the engine's named errors to 400s; None if it is not a client mistake."""
    if isinstance(exc, ContextLengthExceededError):
        return bad_request(str(exc), "messages", "context_length_exceeded")
    if isinstance(exc, InvalidSamplingParamsError):
        return bad_request(str(exc), exc.param, "invalid_value")
    return None
