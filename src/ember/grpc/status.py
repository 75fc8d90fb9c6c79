"""Between Ember's HTTP error replies and gRPC statuses, in both directions.

Server side: an ``APIError`` (status, OpenAI type/param/code, Retry-After)
becomes a status code plus trailers:

=====================================  ============================
HTTP reply                              gRPC status
=====================================  ============================
400 bad argument, 413, other 4xx       INVALID_ARGUMENT
401 / 403                              UNAUTHENTICATED / PERMISSION_DENIED
404 unknown model                      NOT_FOUND
429 queue full, shed, key limit        RESOURCE_EXHAUSTED + retry info
503 "overloaded" (admission deadline)  RESOURCE_EXHAUSTED + retry info
503 loading, draining                  UNAVAILABLE + retry info
504 the call's deadline passed         DEADLINE_EXCEEDED
500                                    INTERNAL
=====================================  ============================

Trailers: ``grpc-status-details-bin`` holds a google.rpc.Status with an
ErrorInfo (reason = the OpenAI error code, metadata = http_status, type,
param) and, when the server suggests a wait, a RetryInfo; ``retry-after-ms``
says the same for clients that do not decode details; ``x-request-id``.

Client side: ``decode`` reverses it. With Ember's ErrorInfo the client gets
the exact HTTP status and error body back, so retries, Retry-After and
failover behave as over HTTP; for any other gRPC server the code alone maps
to the nearest HTTP status.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import grpc

from ember.grpc.api import pb

ERROR_DOMAIN = "ember"
ERROR_INFO_URL = "type.googleapis.com/google.rpc.ErrorInfo"
RETRY_INFO_URL = "type.googleapis.com/google.rpc.RetryInfo"
DETAILS_KEY = "grpc-status-details-bin"

_CODE_OF_STATUS: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    500: grpc.StatusCode.INTERNAL,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}

# The nearest HTTP status of a gRPC code, for errors without Ember's ErrorInfo.
HTTP_STATUS_OF_CODE: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNKNOWN: 500,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.DATA_LOSS: 500,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


# ---------------------------------------------------------------------------
# Server side
# ---------------------------------------------------------------------------


def code_for(status: int, error_code: str | None) -> grpc.StatusCode:
    """The gRPC code of an HTTP error reply (see the table above)."""
    if status == 503:
        return grpc.StatusCode.RESOURCE_EXHAUSTED if error_code == "overloaded" else grpc.StatusCode.UNAVAILABLE
    if status in _CODE_OF_STATUS:
        return _CODE_OF_STATUS[status]
    return grpc.StatusCode.INVALID_ARGUMENT if 400 <= status < 500 else grpc.StatusCode.INTERNAL


def trailers(
    code: grpc.StatusCode,
    message: str,
    *,
    http_status: int,
    error_type: str | None,
    error_code: str | None,
    param: str | None,
    retry_after_s: float | None,
    request_id: str,
) -> list[tuple[str, str | bytes]]:
    """The trailing metadata of an error status (details, retry hint, request id)."""
    metadata = {"http_status": str(http_status)}
    if error_type:
        metadata["type"] = error_type
    if param:
        metadata["param"] = param
    info = pb.ErrorInfo(reason=error_code or "", domain=ERROR_DOMAIN, metadata=metadata)
    status = pb.RpcStatus(code=code.value[0], message=message)
    status.details.add(type_url=ERROR_INFO_URL, value=info.SerializeToString())
    out: list[tuple[str, str | bytes]] = [("x-request-id", request_id)]
    if retry_after_s is not None:
        delay = pb.RetryInfo()
        delay.retry_delay.FromMilliseconds(round(retry_after_s * 1000))
        status.details.add(type_url=RETRY_INFO_URL, value=delay.SerializeToString())
        out.append(("retry-after-ms", str(round(retry_after_s * 1000))))
    out.append((DETAILS_KEY, status.SerializeToString()))
    return out


def retry_after_header(headers: dict[str, str]) -> float | None:
    """Seconds from an ``APIError``'s ``Retry-After`` header (whole seconds), if it has one."""
    value = next((v for k, v in headers.items() if k.lower() == "retry-after"), None)
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return seconds if seconds is not None and math.isfinite(seconds) else None


# ---------------------------------------------------------------------------
# Client side
# ---------------------------------------------------------------------------


@dataclass
class DecodedError:
    """A gRPC error status seen as an HTTP error reply.

    ``from_ember`` is True when the server attached Ember's ErrorInfo, i.e. the
    status came from Ember's own logic and not from the gRPC layer (a refused
    connection is UNAVAILABLE too, but without details).
    """

    code: grpc.StatusCode
    http_status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)
    from_ember: bool = False


def decode(error: grpc.aio.AioRpcError) -> DecodedError:
    """The HTTP view of an ``AioRpcError``: status, OpenAI error body, retry and request-id headers."""
    code = error.code()
    message = error.details() or code.name
    headers: dict[str, str] = {}
    info = None
    for key, value in error.trailing_metadata() or ():
        if key == DETAILS_KEY and isinstance(value, bytes):
            info, retry_ms = _parse_details(value)
            if retry_ms is not None:
                headers.setdefault("retry-after-ms", str(retry_ms))
        elif key in ("x-request-id", "retry-after-ms") and isinstance(value, str):
            headers[key] = value
    if info is not None:
        http_status = _int(info.metadata.get("http_status")) or HTTP_STATUS_OF_CODE.get(code, 500)
        body = {
            "error": {
                "message": message,
                "type": info.metadata.get("type"),
                "param": info.metadata.get("param"),
                "code": info.reason or None,
            }
        }
        return DecodedError(code, http_status, body, headers, from_ember=True)
    body = {"error": {"message": message, "type": None, "param": None, "code": code.name.lower()}}
    return DecodedError(code, HTTP_STATUS_OF_CODE.get(code, 500), body, headers)


def _parse_details(data: bytes) -> tuple[Any | None, int | None]:
    """Ember's ErrorInfo and the RetryInfo delay in ms from a google.rpc.Status, when present."""
    status = pb.RpcStatus()
    try:
        status.ParseFromString(data)
    except Exception:  # a foreign or corrupt trailer is not ours to fail on
        return None, None
    info, retry_ms = None, None
    for detail in status.details:
        if detail.type_url == ERROR_INFO_URL:
            candidate = pb.ErrorInfo()
            candidate.ParseFromString(detail.value)
            if candidate.domain == ERROR_DOMAIN:
                info = candidate
        elif detail.type_url == RETRY_INFO_URL:
            delay = pb.RetryInfo()
            delay.ParseFromString(detail.value)
            retry_ms = delay.retry_delay.ToMilliseconds()
    return info, retry_ms


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text else None
    except ValueError:
        return None
