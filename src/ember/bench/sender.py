"""Send one chat completion over raw httpx and record when each piece arrived.

The benchmark does not use the client SDK on purpose: the SDK retries, fails
over and pre-warms connections, which is right for an application and wrong
for a measurement (a retried request would report the sum of two latencies as
one, a failover would hide an error). Here one request is one HTTP exchange,
retries are off, and every error is recorded by kind.

Chunk times are taken when the bytes leave httpx, before JSON parsing, and one
piece of bytes holding several events gives them all the same time. TCP and
TLS set-up times come from httpcore's ``trace`` extension, so a run with
``new_connection_per_request`` shows what handshakes add to each request.
"""

from __future__ import annotations

import json
import ssl
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import httpx

from ember import __version__
from ember.bench.record import Clock, RequestRecord
from ember.bench.workloads import RequestSpec
from ember.client.defaults import DEFAULT_BASE_URL
from ember.client.sse import SSEDecoder
from ember.client.transport import HTTP_TRANSPORTS
from ember.errors import EmberError

# Any reply of an Ember server carries this header; it tells us `ignore_eos` is understood.
EMBER_REPLY_HEADER = "x-ember-max-tokens"


class BenchError(EmberError):
    """The benchmark cannot run as asked (server unreachable, no model, bad option)."""


@dataclass(frozen=True)
class Target:
    """Where and how to send requests."""

    url: str = DEFAULT_BASE_URL
    model: str | None = None
    api_key: str | None = None
    http2: bool = False
    # Accept a self-signed certificate on https URLs.
    insecure: bool = False
    # Close every connection after its response: each request pays TCP (and TLS) set-up.
    new_connection_per_request: bool = False
    timeout_s: float = 600.0
    # Sent with every request, e.g. (("X-Request-Timeout", "60"),).
    headers: tuple[tuple[str, str], ...] = ()
    # "http1", "http2" (the same as http2=True) or "grpc" (url: grpc://host:port, see grpc_sender.py).
    transport: str = "http1"
    # A CA or self-signed certificate to trust (https and grpcs).
    cacert: str | None = None

    @property
    def chat_url(self) -> str:
        return self.url.rstrip("/") + "/chat/completions"

    @property
    def speaks_http2(self) -> bool:
        return self.http2 or self.transport == "http2"


class _ConnectionTrace:
    """Collects TCP connect and TLS handshake durations of one request from httpcore events."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.started: dict[str, float] = {}
        self.connect_s: float | None = None
        self.tls_s: float | None = None

    async def __call__(self, name: str, info: dict[str, Any]) -> None:
        step, _, phase = name.removeprefix("connection.").rpartition(".")
        if step not in ("connect_tcp", "start_tls"):
            return
        if phase == "started":
            self.started[step] = self.clock()
        elif phase == "complete" and step in self.started:
            elapsed = self.clock() - self.started[step]
            if step == "connect_tcp":
                self.connect_s = elapsed
            else:
                self.tls_s = elapsed


class Sender:
    """Sends ``RequestSpec``s to one target over one shared ``httpx.AsyncClient``.

    Use as ``async with Sender(target, clock) as sender``: entering opens the
    connection pool and asks ``GET /models`` for the model when none was given.
    ``server_is_ember`` turns True once any reply carries Ember's header.
    """

    def __init__(self, target: Target, clock: Clock, *, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.target = target
        self.clock = clock
        self.model = target.model or ""
        self.server_is_ember = False
        # Tests pass an httpx.MockTransport; normally the transports are built from the target.
        self._transport = transport
        self._http: httpx.AsyncClient | None = None

    async def __aenter__(self) -> Sender:
        self._http = self._build_client()
        try:
            if not self.model:
                self.model = await self.discover_model()
        except BaseException:
            await self._http.aclose()
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._http is not None:
            await self._http.aclose()

    def _build_client(self) -> httpx.AsyncClient:
        target = self.target
        limits = httpx.Limits(
            max_connections=None,
            # No idle connection is kept when each request must open its own.
            max_keepalive_connections=0 if target.new_connection_per_request else None,
            keepalive_expiry=60.0,
        )
        headers = {
            # A compressing server would hold tokens in its compressor: ask for none.
            "Accept-Encoding": "identity",
            "User-Agent": f"ember-bench/{__version__}",
        }
        headers.update(dict(target.headers))
        if target.api_key:
            headers["Authorization"] = f"Bearer {target.api_key}"
        timeout = httpx.Timeout(target.timeout_s)
        if self._transport is not None:
            return httpx.AsyncClient(headers=headers, timeout=timeout, transport=self._transport)
        # httpx speaks HTTP/2 over cleartext only with prior knowledge, i.e. with HTTP/1.1 off.
        http2 = target.speaks_http2
        cleartext = httpx.AsyncHTTPTransport(http1=not http2, http2=http2, limits=limits)
        verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=target.cacert) if target.cacert else not target.insecure
        tls = httpx.AsyncHTTPTransport(http2=http2, limits=limits, verify=verify)
        return httpx.AsyncClient(headers=headers, timeout=timeout, transport=tls, mounts={"http://": cleartext})

    @property
    def http(self) -> httpx.AsyncClient:
        if self._http is None:
            raise RuntimeError("use 'async with Sender(...)' before sending")
        return self._http

    async def discover_model(self) -> str:
        """The first model id of ``GET /models``."""
        url = self.target.url.rstrip("/") + "/models"
        try:
            response = await self.http.get(url)
        except httpx.HTTPError as exc:
            if "CERTIFICATE_VERIFY_FAILED" in str(exc):
                raise BenchError(f"{url}: the certificate is not trusted ({exc}); pass --insecure for a self-signed one") from exc
            hint = " and does it speak HTTP/2 (without --http2 it need not)?" if self.target.speaks_http2 else "?"
            raise BenchError(f"cannot reach {url}: {exc!r}; is the server running{hint}") from exc
        if response.status_code != 200:
            raise BenchError(f"GET {url} answered {response.status_code}: {response.text[:200]}; pass --model")
        try:
            return str(response.json()["data"][0]["id"])
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise BenchError(f"GET {url} listed no model; pass --model") from exc

    async def warmup(self, count: int) -> None:
        """Send ``count`` short requests that are not recorded; fail fast if the first one fails.

        Besides warming the server and the connection pool, the replies tell
        whether the server is Ember (``server_is_ember``).
        """
        for index in range(count):
            spec = RequestSpec([{"role": "user", "content": "Say hello."}], max_tokens=2)
            record = await self.send(spec, index=-1 - index)
            if not record.ok:
                raise BenchError(f"warm-up request to {self.target.chat_url} failed ({record.error_kind}): {record.error}")

    async def send(self, spec: RequestSpec, index: int, scheduled_s: float | None = None) -> RequestRecord:
        """Send ``spec`` once (no retries) and return its record; errors are recorded, not raised."""
        record = RequestRecord(
            index=index,
            group=spec.group,
            stream=spec.stream,
            max_tokens=spec.max_tokens,
            conversation_id=spec.conversation_id,
            turn=spec.turn,
            session_id=spec.session_id,
        )
        # Encode before the clock starts: JSON encoding is the client's cost, not the server's.
        content = json.dumps(spec.body(self.model)).encode()
        headers = {"Content-Type": "application/json", **spec.headers()}
        trace = _ConnectionTrace(self.clock)
        record.start_s = self.clock()
        record.scheduled_s = record.start_s if scheduled_s is None else scheduled_s
        try:
            async with self.http.stream(
                "POST", self.target.chat_url, content=content, headers=headers, extensions={"trace": trace}
            ) as response:
                record.status = response.status_code
                if EMBER_REPLY_HEADER in response.headers:
                    self.server_is_ember = True
                if response.status_code != 200:
                    record.error_kind = f"http_{response.status_code}"
                    record.error = _error_message(await response.aread())
                elif spec.stream:
                    await self._read_stream(response, record)
                else:
                    await self._read_full(response, record)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            record.error_kind, record.error = "connect", repr(exc)
        except httpx.TimeoutException as exc:
            record.error_kind, record.error = "timeout", repr(exc)
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            record.error_kind, record.error = "disconnect", repr(exc)
        except httpx.HTTPError as exc:
            record.error_kind, record.error = "transport", repr(exc)
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
            record.error_kind, record.error = "bad_response", repr(exc)
        record.end_s = self.clock()
        record.connect_s, record.tls_s = trace.connect_s, trace.tls_s
        return record

    async def _read_stream(self, response: httpx.Response, record: RequestRecord) -> None:
        decoder = SSEDecoder()
        parts: list[str] = []
        done = False
        # Read to the end of the body even after [DONE]: leaving early would close
        # a keep-alive connection and make the next request pay a new handshake.
        async for piece in response.aiter_bytes():
            arrived_s = self.clock()
            for event in decoder.feed(piece):
                if done or record.error_kind is not None:
                    continue
                if event.data.strip() == "[DONE]":
                    done = True
                    continue
                payload = json.loads(event.data)
                if isinstance(payload, dict) and payload.get("error") is not None:
                    record.error_kind, record.error = "stream_error", _error_message(event.data.encode())
                    continue
                for choice in payload.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content") or ""
                    if text:
                        record.chunk_times_s.append(arrived_s)
                        parts.append(text)
                    if choice.get("finish_reason"):
                        record.finish_reason = choice["finish_reason"]
                        record.stop_reason = _text_or_none(choice.get("stop_reason"))
                if payload.get("usage"):
                    _apply_usage(record, payload["usage"])
        record.output_text = "".join(parts)
        if not done and record.finish_reason is None and record.error_kind is None:
            # The body ended cleanly but the reply did not: no finish_reason, no [DONE].
            record.error_kind, record.error = "incomplete", "stream ended without finish_reason or [DONE]"
        if record.output_tokens is None:
            # No usage chunk (a server without stream_options): one chunk is about one token.
            record.output_tokens = len(record.chunk_times_s)
            record.output_tokens_source = "chunks"

    async def _read_full(self, response: httpx.Response, record: RequestRecord) -> None:
        body = await response.aread()
        arrived_s = self.clock()
        payload = json.loads(body)
        choice = payload["choices"][0]
        text = (choice.get("message") or {}).get("content") or ""
        record.output_text = text
        record.finish_reason = choice.get("finish_reason")
        record.stop_reason = _text_or_none(choice.get("stop_reason"))
        if text:
            # Without streaming the first visible text arrives with the whole reply.
            record.chunk_times_s = [arrived_s]
        if payload.get("usage"):
            _apply_usage(record, payload["usage"])


def make_sender(target: Target, clock: Clock) -> Sender:
    """The sender for ``target.transport``: ``Sender`` (httpx) or ``GrpcSender`` (same interface)."""
    if target.transport == "grpc":
        from ember.bench.grpc_sender import GrpcSender

        return GrpcSender(target, clock)  # type: ignore[return-value]
    if target.transport not in HTTP_TRANSPORTS:
        raise BenchError(f"unknown transport {target.transport!r}: use http1, http2 or grpc")
    return Sender(target, clock)


def _apply_usage(record: RequestRecord, usage: dict[str, Any]) -> None:
    record.prompt_tokens = usage.get("prompt_tokens")
    if usage.get("completion_tokens") is not None:
        record.output_tokens = int(usage["completion_tokens"])
        record.output_tokens_source = "usage"
    details = usage.get("prompt_tokens_details") or {}
    record.cached_tokens = details.get("cached_tokens")


def _text_or_none(value: Any) -> str | None:
    return None if value is None else str(value)


def _error_message(body: bytes) -> str:
    """The ``error.message`` of an OpenAI error body, else the start of the body."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:300].decode("utf-8", errors="replace")
