"""``AsyncClient``: the asyncio client; ``Client`` (client.py) is a blocking shell around it."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import ssl
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any, Literal

from ember import __version__ as ember_version
from ember.client.batch import BatchRequest, run_batch
from ember.client.call import Call, RequestSpec, Timeouts
from ember.client.conversation import AsyncConversation
from ember.client.defaults import DEFAULT_BASE_URL, api_key_from_env
from ember.client.errors import EmberClientError
from ember.client.failover import Endpoints
from ember.client.results import ChatResult, WarmupResult
from ember.client.retry import RetryPolicy
from ember.client.streaming import AsyncChatStream, ResultCallback
from ember.client.transport import TransportName, make_transport

Message = Mapping[str, Any]
Messages = str | Sequence[Message]


class AsyncClient:
    """An OpenAI-compatible chat client with retries, failover and per-phase time limits.

    One instance holds one keep-alive connection pool; share it, and close it
    with ``await client.aclose()`` or ``async with``. ``transport`` picks the
    wire: ``"http1"`` (the default), ``"http2"`` (ALPN on https, prior
    knowledge on plain http; ``http2=True`` is the same) or ``"grpc"`` (Ember's
    ``ember.v1.Generation`` service; base URLs are ``grpc://host:port``, or
    ``grpcs://`` for TLS with ``verify`` naming the CA or certificate file).
    Every transport has the same methods, results, errors, retries, time
    limits and failover.

    ``base_url`` (or several ``base_urls`` in order of preference) defaults to
    ``$EMBER_BASE_URL`` or the local Ember server. ``api_key`` defaults to
    ``$EMBER_API_KEY`` then ``$OPENAI_API_KEY`` and is sent as a Bearer token.
    ``model`` and ``priority`` are defaults for every call.

    Per-call keywords of ``chat`` / ``stream_chat`` / ``complete``: ``headers``,
    ``request_id`` (``X-Request-ID``, generated when absent and repeated on
    retries), ``session_id`` (``X-Session-ID``), ``priority`` (``X-Priority``),
    ``deadline_s`` (overrides ``timeouts.total_s``), ``timeouts`` and ``retry``.
    Every other keyword goes into the JSON body (``max_tokens``, ``temperature``...).
    """

    def __init__(
        self,
        base_url: str | None = None,
        *,
        base_urls: Sequence[str] | None = None,
        api_key: str | None = None,
        model: str | None = None,
        http2: bool = False,
        transport: TransportName | None = None,
        retry: RetryPolicy = RetryPolicy(),
        timeouts: Timeouts = Timeouts(),
        failover_cooldown_s: float = 30.0,
        max_connections: int = 100,
        keepalive_expiry_s: float = 60.0,
        headers: Mapping[str, str] | None = None,
        priority: str | int | None = None,
        include_usage: bool = True,
        verify: ssl.SSLContext | str | bool = True,
    ) -> None:
        if base_url is not None and base_urls is not None:
            raise ValueError("pass base_url or base_urls, not both")
        if base_urls is None:
            base_urls = [base_url or os.environ.get("EMBER_BASE_URL") or DEFAULT_BASE_URL]
        urls = list(base_urls)
        if transport is None:
            transport = "http2" if http2 else "http1"
        elif http2 and transport != "http2":
            raise ValueError(f"http2=True contradicts transport={transport!r}")
        self.model = model
        self.priority = priority
        self.retry = retry
        self.timeouts = timeouts
        self.include_usage = include_usage
        api_key = api_key or api_key_from_env()
        default_headers = {
            "Accept": "application/json, text/event-stream",
            # A compressed stream would sit in the server's compressor instead of reaching us token by token.
            "Accept-Encoding": "identity",
            "User-Agent": f"ember-client/{ember_version}",
            **(headers or {}),
        }
        if api_key:
            default_headers["Authorization"] = f"Bearer {api_key}"
        self._transport = make_transport(
            transport, headers=default_headers, max_connections=max_connections, keepalive_expiry_s=keepalive_expiry_s, verify=verify
        )
        for url in urls:
            self._transport.check_url(url)
        self._endpoints = Endpoints(urls, cooldown_s=failover_cooldown_s)

    @property
    def base_urls(self) -> tuple[str, ...]:
        return self._endpoints.base_urls

    @property
    def transport(self) -> str:
        """The wire this client speaks: "http1", "http2" or "grpc"."""
        return self._transport.name

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close every pooled connection."""
        await self._transport.aclose()

    async def chat(self, messages: Messages, **params: Any) -> ChatResult:
        """Send a chat and return the whole answer.

        Streams under the hood, so the first-token and stall limits apply and
        ``ttft_s`` is real; since nothing reaches the caller before the end, a
        broken stream is retried like any other failed attempt.
        """
        return await self.stream_chat(messages, **params).collect()

    def stream_chat(self, messages: Messages, **params: Any) -> AsyncChatStream:
        """Start a streamed chat: iterate the returned stream for text deltas, then read ``.result``."""
        return self._stream_chat(messages, params)

    async def complete(self, prompt: str, **params: Any) -> ChatResult:
        """A legacy ``/completions`` call with a plain-text prompt; returns the whole answer."""
        return await self._stream("/completions", {"prompt": prompt}, params).collect()

    async def batch(self, requests: Iterable[BatchRequest], *, concurrency: int = 8, **params: Any) -> list[ChatResult | Exception]:
        """Run many chats, at most ``concurrency`` at once, over this client's pool.

        Each request is a message list, a string, or a mapping of ``chat`` keywords
        with ``"messages"``; ``params`` apply to all. Returns, in input order, each
        one's ``ChatResult`` or the exception it ended with: one failure never
        stops the others.
        """
        return await run_batch(self.chat, requests, concurrency=concurrency, params=params)

    async def warmup(self, connections: int = 1, *, probe: Literal["models", "chat"] = "models") -> list[WarmupResult]:
        """Open ``connections`` pooled connections to every base URL before real traffic.

        Each connection carries one small request (``GET /models``, or a 1-token
        chat with ``probe="chat"`` to also warm the server's model path), so the
        first real request pays no TCP/TLS handshake. With HTTP/2 one connection
        carries every request, so more than one adds nothing. A URL that cannot be
        reached starts its failover cool-down; warmup itself never raises for it.
        """
        if connections < 1:
            raise ValueError(f"connections must be >= 1, got {connections}")
        return list(await asyncio.gather(*(self._warm(url, connections, probe) for url in self.base_urls)))

    def conversation(self, system: str | None = None, *, session_id: str | None = None, **params: Any) -> AsyncConversation:
        """A chat that keeps its history and a session id (``X-Session-ID``) so the server keeps its cache hot."""
        return AsyncConversation(self, system=system, session_id=session_id, **params)

    def _stream_chat(self, messages: Messages, params: dict[str, Any], on_result: ResultCallback | None = None) -> AsyncChatStream:
        return self._stream("/chat/completions", {"messages": _as_messages(messages)}, params, on_result)

    def _stream(self, path: str, body: dict[str, Any], params: dict[str, Any], on_result: ResultCallback | None = None) -> AsyncChatStream:
        return AsyncChatStream(self._new_call(path, body, params), on_result=on_result)

    def _new_call(self, path: str, body: dict[str, Any], params: dict[str, Any]) -> Call:
        params = dict(params)
        headers = dict(params.pop("headers", None) or {})
        request_id = params.pop("request_id", None) or _header(headers, "x-request-id") or uuid.uuid4().hex
        session_id = params.pop("session_id", None)
        priority = params.pop("priority", self.priority)
        deadline_s = params.pop("deadline_s", None)
        timeouts: Timeouts = params.pop("timeouts", None) or self.timeouts
        retry: RetryPolicy = params.pop("retry", None) or self.retry
        if "stream" in params:
            raise ValueError("'stream' is set by the method: chat() for a whole answer, stream_chat() for deltas")
        if deadline_s is not None:
            timeouts = dataclasses.replace(timeouts, total_s=deadline_s)
        headers = {k: v for k, v in headers.items() if k.lower() != "x-request-id"}
        headers["X-Request-ID"] = request_id
        if session_id is not None:
            headers["X-Session-ID"] = session_id
        if priority is not None:
            headers["X-Priority"] = str(priority)
        model = params.pop("model", self.model)
        json_body = {**({"model": model} if model is not None else {}), **body, **params, "stream": True}
        if self.include_usage and "stream_options" not in params:
            json_body["stream_options"] = {"include_usage": True}
        spec = RequestSpec("POST", path, json_body, headers, request_id)
        return Call(self._transport, self._endpoints, spec, retry=retry, timeouts=timeouts)

    async def _warm(self, url: str, connections: int, probe: Literal["models", "chat"]) -> WarmupResult:
        started_at = time.monotonic()
        if probe == "models":
            spec = RequestSpec("GET", "/models", None, {}, uuid.uuid4().hex)
        else:
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "stream": False}
            if self.model is not None:
                body["model"] = self.model
            spec = RequestSpec("POST", "/chat/completions", body, {}, uuid.uuid4().hex)
        # A private Endpoints pins each probe to its URL; failures are reported to the shared one below.
        pinned = Endpoints([url])
        calls = [Call(self._transport, pinned, spec, retry=self.retry, timeouts=self.timeouts) for _ in range(connections)]
        http_versions = await asyncio.gather(*(_send_probe(call) for call in calls), return_exceptions=True)
        error = next((e for e in http_versions if isinstance(e, BaseException)), None)
        if isinstance(error, EmberClientError) and calls[0].is_failover_error(error):
            self._endpoints.mark_failed(url)
        if error is not None and not isinstance(error, Exception):
            raise error  # cancellation and the like are not warmup results
        http_version = next((v for v in http_versions if isinstance(v, str)), None)
        return WarmupResult(url, connections, time.monotonic() - started_at, http_version, error)


async def _send_probe(call: Call) -> str:
    async with call.attempt() as reply:
        async for _ in call.chunks(reply):
            pass
        return reply.http_version


def _as_messages(messages: Messages) -> list[dict[str, Any]]:
    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    return [dict(message) for message in messages]


def _header(headers: Mapping[str, str], name: str) -> str | None:
    return next((value for key, value in headers.items() if key.lower() == name), None)
