"""The streaming forwarder: one client request in, one upstream response out, bytes untouched.

The path of a request (an ASGI app mounted on ``/v1/...``):

1. Read the body (capped), pick the session key, ask the policy for candidates.
2. Try candidates in order until one gives a first response body byte. A
   connection error, a stall, or a 429/502/503/504 answer *before the first byte*
   moves on to the next replica, within ``max_attempts`` and the deadline.
   Other answers (a 500 or a 4xx) are the final answer: a 500 may be caused by
   the request itself, and replaying it would spread the damage; the breaker
   takes a replica that keeps answering 500 out of rotation instead.
3. Relay: send the upstream's status and headers (plus ``X-Ember-Upstream``,
   the serving replica's base URL), then every chunk as it arrives
   (``aiter_raw``: no decoding, no re-framing). After the first byte
   nothing is retried; if the upstream breaks, stalls or the deadline passes,
   an SSE stream ends with an error event and ``data: [DONE]``.

The only look into the bytes is for SSE: a chunk is forwarded up to its last
event boundary, so a stream that breaks mid-event can still end on a clean
event. A client that goes away cancels the upstream request within one chunk.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.types import Receive, Scope, Send

from ember.errors import EmberError
from ember.router.config import RouterConfig
from ember.router.errors import INVALID_REQUEST, SERVER_ERROR, error_response, sse_error_events
from ember.router.headers import ClientHeaders, RawHeaders, read_client_headers, upstream_response_headers
from ember.router.metrics import RouterMetrics
from ember.router.policy import choose
from ember.router.replicas import Replica, ReplicaSet, Verdict
from ember.router.request_body import BodyTooLarge, ClientGone, read_body
from ember.router.session_key import MalformedBodyError, request_key

logger = logging.getLogger("ember.router")

# Answers that mean "this replica cannot take it now, another may": retried
# before the first byte. The value is the error kind for metrics.
_RETRY_STATUS_KINDS = {429: "status_429", 502: "status_5xx", 503: "status_503", 504: "status_5xx"}

# Response header naming the replica (its base URL) that served the request.
UPSTREAM_HEADER = b"x-ember-upstream"

_ROUTE_LABELS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/models": "models"}


@dataclass(slots=True)
class _Opened:
    """An upstream response whose first body chunk has arrived; nothing sent to the client yet."""

    replica: Replica
    response: httpx.Response
    chunks: Any  # the response's aiter_raw() iterator, already advanced past ``first_chunk``
    first_chunk: bytes
    sent_at: float


@dataclass(slots=True)
class _Failed:
    """An attempt that may be retried elsewhere; ``answer`` is kept to replay if none succeeds."""

    kind: str
    answer: tuple[int, RawHeaders, bytes] | None = None


class UpstreamBrokenError(EmberError):
    """A non-streaming upstream answer broke after its first byte was forwarded.

    Raised out of the ASGI app on purpose: the server then drops the client
    connection, which is the only honest way to say "this body is incomplete".
    """


class Proxy:
    """ASGI app forwarding ``/v1/*`` to the replicas chosen by the routing policy."""

    def __init__(
        self,
        config: RouterConfig,
        replicas: ReplicaSet,
        metrics: RouterMetrics,
        pool: httpx.AsyncBaseTransport,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._replicas = replicas
        self._metrics = metrics
        self._pool = pool
        self._clock = clock
        self._tick = 0
        # The timeouts of almost every attempt, built once.
        self._default_timeout = self._timeout(config.stall_timeout_s)

    def _timeout(self, stall_s: float) -> dict[str, float | None]:
        connect_s = min(self._config.connect_timeout_s, stall_s)
        return httpx.Timeout(connect=connect_s, read=stall_s, write=stall_s, pool=connect_s).as_dict()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        route = _ROUTE_LABELS.get(path) or ("sessions" if path.startswith("/v1/sessions/") else "other")
        try:
            body = await read_body(receive, self._config.max_body_bytes)
        except BodyTooLarge:
            message = f"Request body is larger than {self._config.max_body_bytes} bytes."
            await self._answer_error(scope, receive, send, route, 413, message, INVALID_REQUEST, "body_too_large")
            return
        except ClientGone:
            return
        client = read_client_headers(scope["headers"])
        try:
            session_key = self._session_key(scope, client, body)
        except MalformedBodyError as exc:
            await self._answer_error(scope, receive, send, route, 400, str(exc), INVALID_REQUEST, "invalid_json")
            return

        timeout_s = self._config.request_timeout_s
        if client.timeout_s is not None and 0 < client.timeout_s < timeout_s:
            timeout_s = client.timeout_s
        deadline = self._clock() + timeout_s
        self._tick += 1
        decision = choose(
            self._config.policy,
            self._replicas.snapshots(),
            session_key=session_key,
            load_epsilon=self._config.load_epsilon,
            load_floor=self._config.load_floor,
            tick=self._tick,
        )

        # Watches for the client leaving, so an abandoned stream stops the upstream too.
        watcher = asyncio.ensure_future(receive())
        try:
            opened, failure, attempts = await self._open_first(
                decision.candidates, scope["method"], _target(scope), client, body or None, deadline, watcher
            )
            if opened is not None:
                if decision.home is not None:
                    self._metrics.affinity(opened.replica.url == decision.home)
                await self._relay(opened, send, watcher, deadline, route, client.request_id)
            elif not watcher.done():
                await self._answer_failure(scope, receive, send, route, failure, attempts, deadline)
        finally:
            watcher.cancel()

    def _session_key(self, scope: Scope, client: ClientHeaders, body: bytes) -> str | None:
        """The key the session policy hashes; the body is parsed only when nothing cheaper names it."""
        if self._config.policy != "session":
            return None
        return request_key(
            client.session_id,
            scope["path"],
            scope["method"],
            body,
            may_be_json=client.may_be_json,
            prompt_chars=self._config.session_prompt_chars,
        )

    async def _open_first(
        self,
        candidates: tuple[str, ...],
        method: str,
        target: str,
        client: ClientHeaders,
        body: bytes | None,
        deadline: float,
        watcher: asyncio.Future[Any],
    ) -> tuple[_Opened | None, _Failed | None, int]:
        """Try candidates in order until one answers with a first body byte."""
        failure: _Failed | None = None
        attempts = 0
        for url in candidates:
            if attempts >= self._config.max_attempts or watcher.done():
                break
            remaining = deadline - self._clock()
            if remaining <= 0:
                break
            replica = self._replicas.get(url)
            if replica is None or not replica.try_begin():
                continue  # removed, or its half-open trial is taken, since the snapshot
            if failure is not None:
                self._metrics.retry(failure.kind)
                request_id = client.request_id.decode("latin-1")
                logger.warning("request %s: retrying on %s after %s", request_id, url, failure.kind)
            attempts += 1
            result = await self._attempt(replica, method, target, client.forward, body, remaining)
            if isinstance(result, _Opened):
                return result, None, attempts
            failure = result
        return None, failure, attempts

    async def _attempt(
        self,
        replica: Replica,
        method: str,
        target: str,
        headers: RawHeaders,
        body: bytes | None,
        remaining_s: float,
    ) -> _Opened | _Failed:
        """Send to one replica and wait for its first body byte; ends the replica's attempt on failure."""
        url = replica.url
        timeout = self._default_timeout if remaining_s >= self._config.stall_timeout_s else self._timeout(remaining_s)
        request = httpx.Request(method, url + target, headers=headers, content=body, extensions={"timeout": timeout})
        sent_at = self._clock()
        response: httpx.Response | None = None
        try:
            # Straight to the connection pool, not through AsyncClient.send: a proxy
            # must not add client headers, keep cookies or follow redirects, and
            # skipping that layer saves about 0.1 ms of the router's TTFT overhead.
            response = await self._pool.handle_async_request(request)
            status = response.status_code
            self._metrics.upstream_answered(url, status)
            retry_kind = _RETRY_STATUS_KINDS.get(status)
            if retry_kind is not None:
                # Raw bytes: they must match the Content-Encoding and -Length being replayed.
                content = b"".join([part async for part in response.aiter_raw()])
                answer = (status, upstream_response_headers(response.headers.raw), content)
                await response.aclose()
                self._metrics.upstream_error(url, retry_kind)
                if status == 503:
                    replica.set_ready(False, "answered 503 (draining or loading)")
                replica.end(Verdict.FAILURE if retry_kind == "status_5xx" else Verdict.NEUTRAL)
                return _Failed(retry_kind, answer)
            chunks = response.aiter_raw()
            try:
                first_chunk = await chunks.__anext__()
            except StopAsyncIteration:
                first_chunk = b""
        except httpx.TransportError as exc:
            if response is not None:
                await response.aclose()
            kind = _transport_error_kind(exc)
            self._metrics.upstream_error(url, kind)
            # Our own pool running dry says nothing about the replica.
            replica.end(Verdict.NEUTRAL if isinstance(exc, httpx.PoolTimeout) else Verdict.FAILURE)
            return _Failed(kind)
        except BaseException:
            if response is not None:
                await response.aclose()
            replica.end(Verdict.NEUTRAL)
            raise
        self._metrics.first_byte(url, self._clock() - sent_at)
        return _Opened(replica, response, chunks, first_chunk, sent_at)

    async def _relay(
        self, opened: _Opened, send: Send, watcher: asyncio.Future[Any], deadline: float, route: str, request_id: bytes
    ) -> None:
        """Stream the opened response to the client; always ends the replica's attempt."""
        response = opened.response
        status = response.status_code
        verdict = Verdict.SUCCESS if status < 500 else Verdict.FAILURE
        content_type = response.headers.get("content-type", "")
        encoding = response.headers.get("content-encoding", "identity")
        # Event boundaries can only be found in plain (not compressed) SSE.
        is_sse = content_type.startswith("text/event-stream") and encoding == "identity"
        headers = upstream_response_headers(response.headers.raw, request_id)
        # Which replica answered: lets clients, logs and tests see affinity and
        # failover per request without access to the router's metrics.
        if self._config.expose_upstream:
            headers.append((UPSTREAM_HEADER, opened.replica.url.encode("latin-1")))
        clock = self._clock
        stall_s = self._config.stall_timeout_s
        tail = b""
        try:
            await send({"type": "http.response.start", "status": status, "headers": headers})
            self._metrics.request_done(route, status)
            chunk = opened.first_chunk
            while True:
                if is_sse:
                    if tail:
                        chunk = tail + chunk
                    cut = _end_of_last_event(chunk)
                    tail = chunk[cut:]
                    chunk = chunk[:cut]  # the whole chunk, without a copy, when it ends an event
                if chunk:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                if watcher.done():
                    verdict = Verdict.NEUTRAL
                    logger.info("request %s: client went away, upstream cancelled", request_id.decode("latin-1"))
                    return
                left_s = deadline - clock()
                past_deadline = False
                try:
                    if left_s >= stall_s:
                        # The usual case: the read's own stall timeout comes first.
                        chunk = await opened.chunks.__anext__()
                    else:
                        # The deadline comes before a stall would be noticed: wait no longer than it.
                        async with asyncio.timeout(max(left_s, 0.0)):
                            chunk = await opened.chunks.__anext__()
                except StopAsyncIteration:
                    break
                except TimeoutError:  # the asyncio.timeout above: the deadline
                    past_deadline = True
                except httpx.TransportError as exc:
                    # A read timeout at the deadline was sized by it (see _attempt): not a stall.
                    past_deadline = isinstance(exc, httpx.TimeoutException) and clock() >= deadline
                    if not past_deadline:
                        verdict = Verdict.FAILURE
                        kind = "stream_stalled" if isinstance(exc, httpx.TimeoutException) else "stream_broken"
                        self._metrics.upstream_error(opened.replica.url, kind)
                        logger.warning(
                            "request %s: upstream %s %s after the first byte: %s",
                            request_id.decode("latin-1"),
                            opened.replica.url,
                            kind,
                            type(exc).__name__,
                        )
                        message = "The upstream replica failed mid-response."
                        await self._end_broken(send, is_sse, message, f"upstream_{kind}")
                        return
                if past_deadline or clock() > deadline:
                    # Nothing that arrives after the deadline is forwarded. A slow
                    # answer is no verdict on the replica's health.
                    verdict = Verdict.NEUTRAL
                    await self._end_broken(send, is_sse, "The request deadline passed.", "deadline_exceeded")
                    return
            await send({"type": "http.response.body", "body": tail, "more_body": False})
        finally:
            await response.aclose()
            opened.replica.end(verdict)
            self._metrics.upstream_finished(opened.replica.url, clock() - opened.sent_at)

    async def _end_broken(self, send: Send, is_sse: bool, message: str, code: str) -> None:
        """End a response that cannot be completed, after its first byte was sent."""
        if not is_sse:
            # A JSON body cannot be amended; dropping the connection tells the
            # client the body is incomplete instead of handing it truncated JSON.
            raise UpstreamBrokenError(f"upstream response broken after the first byte ({code})")
        await send({"type": "http.response.body", "body": sse_error_events(message, code), "more_body": False})

    async def _answer_failure(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        route: str,
        failure: _Failed | None,
        attempts: int,
        deadline: float,
    ) -> None:
        """No replica gave a first byte: replay the last 429/503 answer, or explain in our own words."""
        retry_after = self._config.retry_after_s
        if failure is not None and failure.answer is not None:
            status, headers, content = failure.answer
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": content, "more_body": False})
            self._metrics.request_done(route, status)
        elif attempts == 0 and self._clock() < deadline:
            message = "No upstream replica is available."
            await self._answer_error(scope, receive, send, route, 503, message, SERVER_ERROR, "no_upstream_available", retry_after)
        elif failure is None:
            message = "The request deadline passed before any replica answered."
            await self._answer_error(scope, receive, send, route, 504, message, SERVER_ERROR, "deadline_exceeded")
        else:
            message = f"No upstream replica answered ({attempts} tried, last error: {failure.kind})."
            await self._answer_error(scope, receive, send, route, 502, message, SERVER_ERROR, "upstream_unavailable", retry_after)

    async def _answer_error(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        route: str,
        status: int,
        message: str,
        type: str,
        code: str,
        retry_after_s: int | None = None,
    ) -> None:
        response = error_response(status, message, type=type, code=code, retry_after_s=retry_after_s)
        await response(scope, receive, send)
        self._metrics.request_done(route, status)


def _target(scope: Scope) -> str:
    """Path and query as the client sent them (still percent-encoded)."""
    raw_path: bytes | None = scope.get("raw_path")
    target = raw_path.decode("latin-1") if raw_path else scope["path"]
    query: bytes = scope["query_string"]
    return f"{target}?{query.decode('latin-1')}" if query else target


def _end_of_last_event(data: bytes) -> int:
    """Index just past the last SSE event terminator (blank line) in ``data``, 0 if none."""
    lf = data.rfind(b"\n\n")
    crlf = data.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


def _transport_error_kind(exc: httpx.TransportError) -> str:
    if isinstance(exc, httpx.ConnectError):
        return "connect"
    if isinstance(exc, httpx.TimeoutException):
        return "timeout"
    return "protocol"
