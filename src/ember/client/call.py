"""One logical call: its attempts, their time limits, retry decisions and failover.

A ``Call`` sends attempts (``attempt()``), reads a response as stream chunks
(``chunks()``) and decides whether and when another attempt may follow
(``retry_delay()``). The caller owns the loop around them, because only the
caller knows whether text has already been handed to the user (after which no
retry may happen).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx

from ember.client.errors import (
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    ConnectTimeout,
    DeadlineExceeded,
    EmberClientError,
    FirstTokenTimeout,
    StallTimeout,
    StreamError,
    error_message,
    parse_error_body,
    status_error_class,
)
from ember.client.failover import Endpoints
from ember.client.results import body_as_chunk, chunk_finish_reason
from ember.client.retry import RetryPolicy, backoff_delay, parse_retry_after, parse_should_retry, status_is_retryable
from ember.client.sse import SSEDecoder

T = TypeVar("T")

# How long to wait for the end of a body after its [DONE] before giving up on reusing the connection.
DRAIN_TIMEOUT_S = 0.5


@dataclass(frozen=True)
class Timeouts:
    """Separate time limits of a call, in seconds; None means no limit.

    ``connect_s``: opening one connection. ``first_token_s``: from sending an
    attempt until its first text arrives. ``stall_s``: the longest silence (no
    bytes at all) after the first text. ``total_s``: the whole call including
    every retry and backoff; the remaining part is sent to the server as
    ``X-Request-Timeout`` with each attempt.
    """

    connect_s: float | None = 5.0
    first_token_s: float | None = 30.0
    stall_s: float | None = 15.0
    total_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("connect_s", "first_token_s", "stall_s", "total_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"Timeouts.{name} must be > 0 seconds or None, got {value}")


@dataclass(frozen=True)
class RequestSpec:
    """What to send, the same for every attempt of a call (so ``X-Request-ID`` repeats on retries)."""

    method: str
    path: str
    body: dict[str, Any] | None
    headers: dict[str, str]
    request_id: str


class Call:
    """The state of one logical call across its attempts.

    Invariant: ``attempts`` counts every request sent so far, and every error
    this class raises carries that count, so an error that ends the call tells
    how many requests it cost.
    """

    def __init__(
        self,
        http: httpx.AsyncClient,
        endpoints: Endpoints,
        spec: RequestSpec,
        *,
        retry: RetryPolicy,
        timeouts: Timeouts,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.http = http
        self.endpoints = endpoints
        self.spec = spec
        self.retry = retry
        self.timeouts = timeouts
        self.clock = clock
        self._sleep = sleep
        self._rand = rand
        self._start()
        self.attempts = 0
        self.base_url = endpoints.base_urls[0]
        self.response: httpx.Response | None = None
        self._attempt_started_at = self.started_at
        self._first_token_seen = False

    def _start(self) -> None:
        # Called again by the first attempt: a stream made now but iterated later starts its clock then.
        self.started_at = self.clock()
        self.deadline_at = math.inf if self.timeouts.total_s is None else self.started_at + self.timeouts.total_s

    @property
    def request_id(self) -> str:
        """The server's ``X-Request-ID`` once it answered, else the one sent."""
        if self.response is not None:
            return self.response.headers.get("x-request-id") or self.spec.request_id
        return self.spec.request_id

    def mark_first_token(self) -> None:
        """From now on the stall limit, not the first-token limit, bounds each read."""
        self._first_token_seen = True

    @asynccontextmanager
    async def attempt(self) -> AsyncIterator[httpx.Response]:
        """Send one attempt; yields a 2xx response with its body unread, closes it afterwards.

        Raises an ``APIStatusError`` subclass for an error status and the matching
        ``EmberClientError`` for transport failures and timeouts.
        """
        if self.attempts == 0:
            self._start()
        self.attempts += 1
        self._first_token_seen = False
        self._attempt_started_at = self.clock()
        self.base_url = url = self.endpoints.pick()
        self.response = None
        request = self.http.build_request(
            self.spec.method,
            url + self.spec.path,
            json=self.spec.body,
            headers=self._attempt_headers(),
            # Only the connect limit is httpx's job; reads are bounded by _within_budget.
            timeout=httpx.Timeout(connect=self.timeouts.connect_s, read=None, write=None, pool=None),
        )
        response = await self._within_budget(self.http.send(request, stream=True))
        try:
            if not response.is_success:
                raise await self._status_error(response)
            self.endpoints.mark_ok(url)
            self.response = response
            yield response
        finally:
            await response.aclose()

    async def chunks(self, response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
        """The JSON chunks of a response until ``data: [DONE]``.

        A plain JSON body (a server that ignored ``stream: true``) becomes one
        chunk. Raises ``StreamError`` for an error chunk and ``APIConnectionError``
        when the stream ends before it was complete.
        """
        if "text/event-stream" not in response.headers.get("content-type", ""):
            content = await self._within_budget(response.aread())
            yield body_as_chunk(self._parse_json(content.decode("utf-8", errors="replace")))
            return
        decoder = SSEDecoder()
        byte_iterator = response.aiter_bytes()
        finished = False
        while (data := await self._within_budget(_next_or_none(byte_iterator))) is not None:
            for event in decoder.feed(data):
                if event.data == "[DONE]":
                    await _drain(byte_iterator)
                    return
                chunk = self._parse_json(event.data)
                if "error" in chunk:
                    raise self._error(StreamError, error_message(chunk, "error in stream"), body=chunk)
                finished = finished or chunk_finish_reason(chunk) is not None
                yield chunk
        if not finished:  # a clean close is fine once a finish_reason arrived, even without [DONE]
            raise self._error(APIConnectionError, "the stream ended before it was complete (no data: [DONE])")

    def retry_delay(self, error: EmberClientError) -> float | None:
        """Seconds to wait before the next attempt, or None when the call must fail with ``error``.

        Moving to another base URL that is not cooling down needs no wait; the
        backoff (or the server's Retry-After) applies to coming back to the same one.
        A wait that would end past the deadline is not worth starting.
        """
        if self.attempts > self.retry.max_retries or not self._is_retryable(error):
            return None
        failed_over = self.is_failover_error(error) and self.endpoints.can_fail_over_from(self.base_url)
        if failed_over:
            delay_s = 0.0
        else:
            retry_after_s = error.retry_after_s if isinstance(error, APIStatusError) else None
            delay_s = backoff_delay(self.retry, self.attempts, retry_after_s=retry_after_s, random=self._rand)
        if self.clock() + delay_s >= self.deadline_at:
            return None
        return delay_s

    async def sleep(self, seconds: float) -> None:
        if seconds > 0:
            await self._sleep(seconds)

    def _is_retryable(self, error: EmberClientError) -> bool:
        if isinstance(error, APIStatusError):
            return status_is_retryable(self.retry, error.status_code or 0, error.should_retry)
        if isinstance(error, (APIConnectionError, ConnectTimeout)):
            return self.retry.retry_connection_errors
        return False  # other timeouts and stream errors: the server may still be working on it

    def is_failover_error(self, error: EmberClientError) -> bool:
        """True for failures that mean "try another base URL": connection errors and 503."""
        if isinstance(error, APIStatusError):
            return error.status_code in self.endpoints.failover_statuses
        return isinstance(error, (APIConnectionError, ConnectTimeout))

    def _attempt_headers(self) -> dict[str, str]:
        headers = dict(self.spec.headers)
        if self.deadline_at != math.inf:
            remaining_s = max(self.deadline_at - self.clock(), 0.0)
            headers["X-Request-Timeout"] = f"{remaining_s:.3f}"
        return headers

    def _budget(self) -> tuple[float, type[APITimeoutError], str]:
        """How long the next wait may take, and which error to raise when it does not end in time."""
        now = self.clock()
        if self._first_token_seen:
            stall_s = self.timeouts.stall_s
            budget_s = math.inf if stall_s is None else stall_s
            kind: type[APITimeoutError] = StallTimeout
            message = f"the stream stalled: no bytes for {stall_s} s"
        else:
            first_token_s = self.timeouts.first_token_s
            budget_s = math.inf if first_token_s is None else self._attempt_started_at + first_token_s - now
            kind, message = FirstTokenTimeout, f"no first token within {first_token_s} s"
        if self.deadline_at - now <= budget_s:
            return self.deadline_at - now, DeadlineExceeded, f"the deadline of {self.timeouts.total_s} s ran out"
        return budget_s, kind, message

    async def _within_budget(self, awaitable: Awaitable[T]) -> T:
        """Await one step of an attempt under the current time limit, translating failures."""
        budget_s, timeout_kind, timeout_message = self._budget()
        try:
            return await asyncio.wait_for(awaitable, timeout=None if budget_s == math.inf else max(budget_s, 0.0))
        except asyncio.TimeoutError:
            raise self._error(timeout_kind, timeout_message) from None
        except httpx.ConnectTimeout as exc:
            self.endpoints.mark_failed(self.base_url)
            raise self._error(ConnectTimeout, f"connecting to {self.base_url} timed out") from exc
        except (httpx.NetworkError, httpx.RemoteProtocolError) as exc:
            self.endpoints.mark_failed(self.base_url)
            raise self._error(APIConnectionError, f"connection to {self.base_url} failed: {exc!r}") from exc
        except httpx.HTTPError as exc:  # local protocol errors, decoding errors: retrying cannot help
            raise self._error(EmberClientError, f"request failed: {exc!r}") from exc

    async def _status_error(self, response: httpx.Response) -> APIStatusError:
        content = await self._within_budget(response.aread())
        body = parse_error_body(content)
        if response.status_code in self.endpoints.failover_statuses:
            self.endpoints.mark_failed(self.base_url)
        error_class = status_error_class(response.status_code)
        return error_class(
            error_message(body, f"HTTP {response.status_code}"),
            status_code=response.status_code,
            body=body,
            request_id=response.headers.get("x-request-id") or self.spec.request_id,
            attempts=self.attempts,
            base_url=self.base_url,
            retry_after_s=parse_retry_after(response.headers),
            should_retry=parse_should_retry(response.headers),
        )

    def _parse_json(self, text: str) -> dict[str, Any]:
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise self._error(StreamError, f"the server sent a malformed chunk: {text[:200]!r}")
        return value

    def _error(self, kind: type[EmberClientError], message: str, **fields: Any) -> EmberClientError:
        return kind(message, request_id=self.request_id, attempts=self.attempts, base_url=self.base_url, **fields)


async def _drain(byte_iterator: AsyncIterator[bytes]) -> None:
    """Read what follows ``[DONE]`` (normally only the end of the body) so the connection returns to the pool.

    httpx drops a connection whose response was closed unread; on HTTP/1.1 that
    would cost every streamed call a new TCP handshake.
    """
    try:
        await asyncio.wait_for(_read_to_end(byte_iterator), timeout=DRAIN_TIMEOUT_S)
    except (asyncio.TimeoutError, httpx.HTTPError):
        pass  # the answer is complete; only this connection's reuse is lost


async def _read_to_end(byte_iterator: AsyncIterator[bytes]) -> None:
    async for _ in byte_iterator:
        pass


async def _next_or_none(iterator: AsyncIterator[bytes]) -> bytes | None:
    try:
        return await iterator.__anext__()
    except StopAsyncIteration:
        return None
