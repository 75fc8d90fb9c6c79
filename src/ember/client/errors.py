"""The client's exception hierarchy.

Every error the client raises on purpose derives from ``EmberClientError``::

    EmberClientError
    ├── APIConnectionError        could not connect, or the connection broke
    ├── APITimeoutError           a client-side time limit ran out
    │   ├── ConnectTimeout        TCP/TLS connect took longer than ``Timeouts.connect_s``
    │   ├── FirstTokenTimeout     no first token within ``Timeouts.first_token_s``
    │   ├── StallTimeout          no bytes for ``Timeouts.stall_s`` mid-stream
    │   └── DeadlineExceeded      the whole call ran past its deadline
    ├── APIStatusError            the server answered with an error status
    │   ├── BadRequestError       400, 404, 409, 413, 422 and other 4xx
    │   ├── AuthenticationError   401, 403
    │   ├── RateLimitedError      429
    │   └── ServerError           5xx
    └── StreamError               the server sent an error chunk after the stream began

Each carries what is known about the failure: ``status_code``, the parsed OpenAI
error ``body`` (``{"error": {"message", "type", "param", "code"}}``), the
``request_id`` (the response's ``X-Request-ID``, else the one the client sent),
``attempts`` (how many requests the call made in total) and ``base_url``.
"""

from __future__ import annotations

import json
from typing import Any

from ember.errors import EmberError


class EmberClientError(EmberError):
    """Base class of every error the client raises on purpose."""

    def __init__(
        self,
        message: str,
        *,
        status_code: int | None = None,
        body: Any = None,
        request_id: str | None = None,
        attempts: int = 1,
        base_url: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.body = body
        self.request_id = request_id
        self.attempts = attempts
        self.base_url = base_url

    @property
    def retries(self) -> int:
        """Requests made after the first one."""
        return max(0, self.attempts - 1)

    @property
    def error(self) -> dict[str, Any]:
        """The inner OpenAI error object, or ``{}`` when the body has none."""
        if isinstance(self.body, dict) and isinstance(self.body.get("error"), dict):
            return self.body["error"]
        return {}

    @property
    def error_type(self) -> str | None:
        return self.error.get("type")

    @property
    def code(self) -> Any:
        return self.error.get("code")

    @property
    def param(self) -> str | None:
        return self.error.get("param")

    def __str__(self) -> str:
        parts = [self.message]
        if self.status_code is not None:
            parts.append(f"status={self.status_code}")
        if self.request_id:
            parts.append(f"request_id={self.request_id}")
        if self.attempts > 1:
            parts.append(f"attempts={self.attempts}")
        return " | ".join(parts)


class APIConnectionError(EmberClientError):
    """The connection could not be opened, or it broke before the answer was complete."""


class APITimeoutError(EmberClientError):
    """A client-side time limit ran out; the subclass says which one."""


class ConnectTimeout(APITimeoutError):
    """Opening the connection took longer than ``Timeouts.connect_s`` (retried like a connection error)."""


class FirstTokenTimeout(APITimeoutError):
    """The first token did not arrive within ``Timeouts.first_token_s`` of sending the request."""


class StallTimeout(APITimeoutError):
    """The stream went silent (no bytes at all) for ``Timeouts.stall_s`` after the first token."""


class DeadlineExceeded(APITimeoutError):
    """The call's total deadline (``Timeouts.total_s`` or ``deadline_s=``) ran out."""


class APIStatusError(EmberClientError):
    """The server answered with an error status.

    Also used as is for statuses without a dedicated subclass (408, 3xx...).
    ``retry_after_s`` is the server's ``Retry-After`` hint in seconds (or None),
    ``should_retry`` its ``x-should-retry`` verdict (or None when absent).
    """

    def __init__(
        self,
        message: str,
        *,
        retry_after_s: float | None = None,
        should_retry: bool | None = None,
        **fields: Any,
    ) -> None:
        super().__init__(message, **fields)
        self.retry_after_s = retry_after_s
        self.should_retry = should_retry


class BadRequestError(APIStatusError):
    """The server rejected the request itself (400, 404, 409, 413, 422 and other 4xx)."""


class AuthenticationError(APIStatusError):
    """The API key is missing, wrong, or not allowed to do this (401, 403)."""


class RateLimitedError(APIStatusError):
    """The server is shedding load (429); ``retry_after_s`` says when to come back."""


class ServerError(APIStatusError):
    """The server failed (5xx)."""


class StreamError(EmberClientError):
    """The server reported an error inside a stream that had already started (HTTP 200).

    Never retried: the stream may already have handed text to the caller.
    """


def status_error_class(status_code: int) -> type[APIStatusError]:
    """The exception class for an HTTP error status."""
    if status_code in (401, 403):
        return AuthenticationError
    if status_code == 429:
        return RateLimitedError
    if status_code == 408:
        # A server-side timeout: neither the caller's fault nor a crash.
        return APIStatusError
    if 400 <= status_code < 500:
        return BadRequestError
    if status_code >= 500:
        return ServerError
    return APIStatusError


def parse_error_body(content: bytes) -> Any:
    """The JSON body of an error response, or ``{"error": {"message": <text>}}`` for non-JSON."""
    try:
        return json.loads(content)
    except ValueError:
        text = content.decode("utf-8", errors="replace").strip()
        return {"error": {"message": text, "type": None, "param": None, "code": None}}


def error_message(body: Any, fallback: str) -> str:
    """The human message inside an OpenAI error body, else ``fallback``."""
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str) and error:
            return error
    return fallback
