"""HTTP/1.1 and HTTP/2 transport (httpx): one keep-alive pool, SSE decoding, httpx errors mapped."""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import httpx

from ember.client.errors import APIConnectionError, ConnectTimeout, EmberClientError, StreamError, error_message, parse_error_body
from ember.client.results import body_as_chunk, chunk_finish_reason
from ember.client.sse import SSEDecoder

if TYPE_CHECKING:
    from ember.client.call import Call

# How long to wait for the end of a body after its [DONE] before giving up on reusing the connection.
DRAIN_TIMEOUT_S = 0.5


class HTTPReply:
    """A 2xx ``httpx.Response`` whose body is still unread."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self.http_version = response.http_version

    def header(self, name: str) -> str | None:
        return self.response.headers.get(name)


class HTTPTransport:
    """OpenAI's HTTP API over httpx: HTTP/1.1, or HTTP/2 (ALPN on https, prior knowledge on http)."""

    def __init__(
        self,
        *,
        http2: bool,
        headers: Mapping[str, str],
        max_connections: int,
        keepalive_expiry_s: float,
        verify: ssl.SSLContext | str | bool,
    ) -> None:
        self.name = "http2" if http2 else "http1"
        limits = httpx.Limits(
            max_connections=max_connections,
            # Keep every connection warmup opened: an idle pooled connection is the point.
            max_keepalive_connections=max_connections,
            keepalive_expiry=keepalive_expiry_s,
        )
        # httpx only speaks HTTP/2 over cleartext with prior knowledge, i.e. with HTTP/1.1 off.
        cleartext = httpx.AsyncHTTPTransport(http1=not http2, http2=http2, limits=limits)
        tls = httpx.AsyncHTTPTransport(http2=http2, limits=limits, verify=verify)
        self.http = httpx.AsyncClient(headers=dict(headers), transport=tls, mounts={"http://": cleartext})

    def check_url(self, url: str) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"base URL must start with http:// or https://, got {url!r}")

    async def aclose(self) -> None:
        await self.http.aclose()

    @asynccontextmanager
    async def send(self, call: Call, url: str, headers: dict[str, str]) -> AsyncIterator[HTTPReply]:
        spec = call.spec
        request = self.http.build_request(
            spec.method,
            url + spec.path,
            json=spec.body,
            headers=headers,
            # Only the connect limit is httpx's job; reads are bounded by Call.within_budget.
            timeout=httpx.Timeout(connect=call.timeouts.connect_s, read=None, write=None, pool=None),
        )
        response = await call.within_budget(self.http.send(request, stream=True))
        try:
            if not response.is_success:
                content = await call.within_budget(response.aread())
                raise call.status_error(response.status_code, parse_error_body(content), response.headers)
            yield HTTPReply(response)
        finally:
            await response.aclose()

    async def chunks(self, call: Call, reply: HTTPReply) -> AsyncIterator[dict[str, Any]]:
        """The JSON chunks of a response until ``data: [DONE]``.

        A plain JSON body (a server that ignored ``stream: true``) becomes one
        chunk. Raises ``StreamError`` for an error chunk and ``APIConnectionError``
        when the stream ends before it was complete.
        """
        response = reply.response
        if "text/event-stream" not in response.headers.get("content-type", ""):
            content = await call.within_budget(response.aread())
            yield body_as_chunk(_parse_json(call, content.decode("utf-8", errors="replace")))
            return
        decoder = SSEDecoder()
        byte_iterator = response.aiter_bytes()
        finished = False
        while (data := await call.within_budget(_next_or_none(byte_iterator))) is not None:
            for event in decoder.feed(data):
                if event.data == "[DONE]":
                    await _drain(byte_iterator)
                    return
                chunk = _parse_json(call, event.data)
                if "error" in chunk:
                    raise call.error(StreamError, error_message(chunk, "error in stream"), body=chunk)
                finished = finished or chunk_finish_reason(chunk) is not None
                yield chunk
        if not finished:  # a clean close is fine once a finish_reason arrived, even without [DONE]
            raise call.error(APIConnectionError, "the stream ended before it was complete (no data: [DONE])")

    def translate(self, call: Call, exc: BaseException) -> EmberClientError | None:
        if isinstance(exc, httpx.ConnectTimeout):
            call.endpoints.mark_failed(call.base_url)
            return call.error(ConnectTimeout, f"connecting to {call.base_url} timed out")
        if isinstance(exc, (httpx.NetworkError, httpx.RemoteProtocolError)):
            call.endpoints.mark_failed(call.base_url)
            return call.error(APIConnectionError, f"connection to {call.base_url} failed: {exc!r}")
        if isinstance(exc, httpx.HTTPError):  # local protocol errors, decoding errors: retrying cannot help
            return call.error(EmberClientError, f"request failed: {exc!r}")
        return None


def _parse_json(call: Call, text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise call.error(StreamError, f"the server sent a malformed chunk: {text[:200]!r}")
    return value


async def _drain(byte_iterator: AsyncIterator[bytes]) -> None:
    """Read what follows ``[DONE]`` (normally only the end of the body) so the connection returns to the pool.

    httpx drops a connection whose response was closed unread; on HTTP/1.1 that
    would cost every streamed call a new TCP handshake.
    """
    try:
        await asyncio.wait_for(_read_to_end(byte_iterator), timeout=DRAIN_TIMEOUT_S)
    except (TimeoutError, httpx.HTTPError):
        pass  # the answer is complete; only this connection's reuse is lost


async def _read_to_end(byte_iterator: AsyncIterator[bytes]) -> None:
    async for _ in byte_iterator:
        pass


async def _next_or_none(iterator: AsyncIterator[bytes]) -> bytes | None:
    try:
        return await iterator.__anext__()
    except StopAsyncIteration:
        return None
