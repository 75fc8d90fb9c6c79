"""gRPC transport: ``ember.v1.Generation`` over one grpc.aio channel per base URL.

Base URLs are ``grpc://host:port`` (cleartext) or ``grpcs://host:port`` (TLS;
``verify`` may name a CA or certificate file, since gRPC cannot skip
verification). ``/chat/completions`` is the streaming ``Chat`` method,
``/completions`` the unary ``Complete``, and the warmup probe ``GET /models``
a health check.

The mapping onto ``Call``'s semantics:

- headers become metadata (``authorization``, ``x-request-id``,
  ``x-session-id``, ``x-priority`` ...); the remaining deadline
  (``X-Request-Timeout``) becomes the gRPC deadline;
- an attempt is accepted when its first message arrives (Ember sends one as
  soon as the request is admitted), as an HTTP attempt is by its status line;
- error statuses become the HTTP error they stand for (``ember.grpc.status``),
  so ``RetryPolicy``, Retry-After (RetryInfo) and 503 failover apply unchanged;
  a failed connection (UNAVAILABLE without Ember's details) is an
  ``APIConnectionError``, DEADLINE_EXCEEDED a ``DeadlineExceeded``;
- ``Timeouts.connect_s`` bounds the channel's connection when it is not
  connected yet (a ``ConnectTimeout``, retried like a refused connection);
- an error after the stream started is a ``StreamError`` (the server's) or an
  ``APIConnectionError`` (the connection's), as over HTTP.

The channel reconnects with a short backoff (at most 1 s) so that the retry
policy, not gRPC's own reconnect schedule, paces attempts.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ember import __version__
from ember.client.errors import APIConnectionError, ConnectTimeout, DeadlineExceeded, EmberClientError, StreamError
from ember.grpc import convert, status
from ember.grpc.api import SERVICE_NAME, pb_grpc

if TYPE_CHECKING:
    from ember.client.call import Call

# Headers with no meaning as gRPC metadata (gRPC sets its own content type and user agent).
_SKIPPED_HEADERS = frozenset({"accept", "accept-encoding", "user-agent", "content-type", "x-request-timeout", "connection", "host", "te"})
_CHANNEL_OPTIONS = (
    ("grpc.primary_user_agent", f"ember-client/{__version__}"),
    ("grpc.enable_retries", 0),  # Call retries, with Ember's policy
    ("grpc.max_receive_message_length", -1),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


@dataclass
class GrpcReply:
    """An accepted gRPC attempt: the chunks already received and, for ``Chat``, the call still streaming."""

    pending: list[dict[str, Any]]
    metadata: dict[str, str] = field(default_factory=dict)
    rpc: Any = None  # grpc.aio.UnaryStreamCall while more messages may come
    http_version: str = "grpc"

    def header(self, name: str) -> str | None:
        return self.metadata.get(name)


@dataclass
class _Channel:
    channel: grpc.aio.Channel
    generation: Any
    health: Any


class GrpcTransport:
    """Ember's gRPC API as a ``Transport``."""

    name = "grpc"

    def __init__(self, *, headers: Mapping[str, str], verify: ssl.SSLContext | str | bool) -> None:
        self._metadata = _metadata(headers)
        self._verify = verify
        self._channels: dict[str, _Channel] = {}

    def check_url(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("grpc", "grpcs") or not parts.hostname or parts.port is None:
            raise ValueError(f"a gRPC base URL is grpc://host:port or grpcs://host:port, got {url!r}")
        if parts.scheme == "grpcs" and (self._verify is False or isinstance(self._verify, ssl.SSLContext)):
            raise ValueError("gRPC over TLS verifies the server: pass verify=True (system CAs) or verify='ca-or-cert.pem'")

    async def aclose(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for entry in channels:
            await entry.channel.close()

    @asynccontextmanager
    async def send(self, call: Call, url: str, headers: dict[str, str]) -> AsyncIterator[GrpcReply]:
        spec = call.spec
        entry = self._channel(url)
        metadata = tuple({**dict(self._metadata), **dict(_metadata(headers))}.items())
        timeout = _deadline_s(headers)
        await self._connect(call, entry.channel)
        if spec.method == "POST" and spec.path == "/chat/completions":
            rpc = entry.generation.Chat(convert.chat_request(spec.body or {}), metadata=metadata, timeout=timeout)
            try:
                first = await call.within_budget(rpc.read())
                if first is grpc.aio.EOF:
                    raise call.error(APIConnectionError, "the stream ended before its first message")
                initial = dict(await rpc.initial_metadata())
                yield GrpcReply([convert.chat_chunk_dict(first)], initial, rpc)
            finally:
                rpc.cancel()  # no-op once finished; otherwise the server aborts the generation
        elif spec.method == "POST" and spec.path == "/completions":
            rpc = entry.generation.Complete(convert.complete_request(spec.body or {}), metadata=metadata, timeout=timeout)
            try:
                response = await call.within_budget(_await(rpc))
                yield GrpcReply([convert.completion_dict(response)], dict(await rpc.initial_metadata()))
            finally:
                rpc.cancel()
        elif spec.method == "GET" and spec.path == "/models":
            request = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
            health = await call.within_budget(entry.health.Check(request, metadata=metadata, timeout=timeout))
            if health.status != health_pb2.HealthCheckResponse.SERVING:
                body = {
                    "error": {
                        "message": "the server is not serving (gRPC health check)",
                        "type": "service_unavailable",
                        "param": None,
                        "code": "not_serving",
                    }
                }
                raise call.status_error(503, body, {})
            yield GrpcReply([])
        else:
            raise ValueError(f"{spec.method} {spec.path} has no gRPC equivalent")

    async def chunks(self, call: Call, reply: GrpcReply) -> AsyncIterator[dict[str, Any]]:
        finished = False
        for chunk in reply.pending:
            finished = finished or _finished(chunk)
            yield chunk
        if reply.rpc is None:
            return
        while (message := await call.within_budget(self._read(call, reply.rpc))) is not grpc.aio.EOF:
            chunk = convert.chat_chunk_dict(message)
            finished = finished or _finished(chunk)
            yield chunk
        if not finished:
            raise call.error(APIConnectionError, "the stream ended before it was complete (no finish_reason)")

    def translate(self, call: Call, exc: BaseException) -> EmberClientError | None:
        """Errors before the reply was accepted: an error status, a failed connection, the deadline."""
        if not isinstance(exc, grpc.aio.AioRpcError):
            return None
        decoded = status.decode(exc)
        if decoded.code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return call.error(DeadlineExceeded, f"the deadline ran out ({decoded.body['error']['message']})")
        if not decoded.from_ember and decoded.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
            call.endpoints.mark_failed(call.base_url)
            return call.error(APIConnectionError, f"connection to {call.base_url} failed: {exc.details()}")
        return call.status_error(decoded.http_status, decoded.body, decoded.headers)

    async def _read(self, call: Call, rpc: Any) -> Any:
        """The next message; an error status after the stream started becomes a stream error."""
        try:
            return await rpc.read()
        except grpc.aio.AioRpcError as exc:
            decoded = status.decode(exc)
            if decoded.code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise call.error(DeadlineExceeded, f"the deadline ran out ({exc.details()})") from exc
            if decoded.from_ember:
                raise call.error(StreamError, decoded.body["error"]["message"], status_code=decoded.http_status, body=decoded.body) from exc
            call.endpoints.mark_failed(call.base_url)
            raise call.error(APIConnectionError, f"the stream from {call.base_url} broke: {exc.code().name} {exc.details()}") from exc

    async def _connect(self, call: Call, channel: grpc.aio.Channel) -> None:
        """Bound a fresh connection by ``connect_s``; a channel that already failed lets the RPC fail fast."""
        state = channel.get_state(try_to_connect=True)
        if state in (grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.TRANSIENT_FAILURE):
            return
        settled = (grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN)

        async def settle() -> grpc.ChannelConnectivity:
            current = channel.get_state(try_to_connect=True)
            while current not in settled:
                await channel.wait_for_state_change(current)
                current = channel.get_state(try_to_connect=True)
            return current

        try:
            await asyncio.wait_for(settle(), timeout=call.timeouts.connect_s)
        except TimeoutError:
            call.endpoints.mark_failed(call.base_url)
            raise call.error(ConnectTimeout, f"connecting to {call.base_url} timed out") from None
        # TRANSIENT_FAILURE: the RPC itself fails at once with UNAVAILABLE, reported as a connection error.

    def _channel(self, url: str) -> _Channel:
        entry = self._channels.get(url)
        if entry is None:
            parts = urlsplit(url)
            target = f"[{parts.hostname}]:{parts.port}" if ":" in (parts.hostname or "") else f"{parts.hostname}:{parts.port}"
            if parts.scheme == "grpcs":
                roots = Path(self._verify).read_bytes() if isinstance(self._verify, str) else None
                channel = grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=roots), options=_CHANNEL_OPTIONS)
            else:
                channel = grpc.aio.insecure_channel(target, options=_CHANNEL_OPTIONS)
            entry = _Channel(channel, pb_grpc.GenerationStub(channel), health_pb2_grpc.HealthStub(channel))
            self._channels[url] = entry
        return entry


def _metadata(headers: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple((name.lower(), value) for name, value in headers.items() if name.lower() not in _SKIPPED_HEADERS)


def _deadline_s(headers: Mapping[str, str]) -> float | None:
    value = next((v for k, v in headers.items() if k.lower() == "x-request-timeout"), None)
    return None if value is None else max(float(value), 0.001)


def _finished(chunk: dict[str, Any]) -> bool:
    return any(choice.get("finish_reason") for choice in chunk.get("choices") or ())


async def _await(rpc: Any) -> Any:
    return await rpc
