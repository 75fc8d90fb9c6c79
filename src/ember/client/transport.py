"""The wire under a ``Call``: HTTP/1.1, HTTP/2 (both httpx) or gRPC.

A ``Call`` (call.py) owns everything that does not depend on the wire:
attempts, time limits, retry decisions, failover and the errors' bookkeeping.
A transport only sends one attempt and reads its answer:

- ``send(call, url, headers)``: an async context manager that sends the
  attempt described by ``call.spec`` to ``url`` and yields a ``Reply`` once
  the server accepted it (HTTP: a 2xx status line; gRPC: the first message).
  An error status raises ``call.status_error(...)``; every await goes through
  ``call.within_budget`` so the call's time limits apply.
- ``chunks(call, reply)``: the answer as OpenAI chunk dicts (what a
  ``data:`` event of ``/chat/completions`` holds), whatever the wire carried.
- ``translate(call, exc)``: the client error for an exception of the
  transport's library (a refused connection...), or None when it is not one.

Because retries, deadlines and failover live in ``Call`` and the stream
reader only sees chunk dicts, every transport gets the same semantics.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, Literal, Protocol, get_args

from ember.client.errors import EmberClientError

if TYPE_CHECKING:
    from ember.client.call import Call

TransportName = Literal["http1", "http2", "grpc"]
# The names, for argparse choices and checks: one definition, the Literal's.
TRANSPORTS: tuple[TransportName, ...] = get_args(TransportName)
HTTP_TRANSPORTS: tuple[TransportName, ...] = ("http1", "http2")


class Reply(Protocol):
    """An accepted attempt: what the stream reader and the result need from it."""

    # "HTTP/1.1", "HTTP/2" or "grpc".
    http_version: str

    def header(self, name: str) -> str | None:
        """A response header (HTTP) or initial metadata value (gRPC), by lower-case name."""
        ...


class Transport(Protocol):
    """Sends attempts over one kind of wire; owns that wire's connections (close with ``aclose``)."""

    name: str

    def check_url(self, url: str) -> None:
        """Raise ``ValueError`` when ``url`` is not a base URL this transport can use."""
        ...

    def send(self, call: Call, url: str, headers: dict[str, str]) -> AbstractAsyncContextManager[Reply]: ...

    def chunks(self, call: Call, reply: Any) -> AsyncIterator[dict[str, Any]]: ...

    def translate(self, call: Call, exc: BaseException) -> EmberClientError | None: ...

    async def aclose(self) -> None: ...


def make_transport(
    name: str,
    *,
    headers: Mapping[str, str],
    max_connections: int,
    keepalive_expiry_s: float,
    verify: ssl.SSLContext | str | bool,
) -> Transport:
    """The transport called ``name`` ("http1", "http2" or "grpc")."""
    if name in HTTP_TRANSPORTS:
        from ember.client.http_transport import HTTPTransport

        return HTTPTransport(
            http2=name == "http2", headers=headers, max_connections=max_connections, keepalive_expiry_s=keepalive_expiry_s, verify=verify
        )
    if name == "grpc":
        from ember.client.grpc_transport import GrpcTransport

        return GrpcTransport(headers=headers, verify=verify)
    raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {name!r}")
