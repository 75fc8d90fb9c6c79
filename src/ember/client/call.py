"""One logical call: its attempts, their time limits, retry decisions and failover.

A ``Call`` sends attempts (``attempt()``), reads a response as stream chunks
(``chunks()``) and decides whether and when another attempt may follow
(``retry_delay()``). The caller owns the loop around them, because only the
caller knows whether text has already been handed to the user (after which no
retry may happen). The wire itself (HTTP/1.1, HTTP/2 or gRPC) is the
``Transport``'s business (transport.py); everything here is the same for all.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from ember.client.errors import (
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    ConnectTimeout,
    DeadlineExceeded,
    EmberClientError,
    FirstTokenTimeout,
    StallTimeout,
    error_message,
    status_error_class,
)
from ember.client.failover import Endpoints
from ember.client.retry import RetryPolicy, backoff_delay, parse_retry_after, parse_should_retry, status_is_retryable
from ember.client.transport import Reply, Transport

T = TypeVar("T")


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
        transport: Transport,
        endpoints: Endpoints,
        spec: RequestSpec,
        *,
        retry: RetryPolicy,
        timeouts: Timeouts,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.transport = transport
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
        self.reply: Reply | None = None
        self._attempt_started_at = self.started_at
        self._first_token_seen = False

    def _start(self) -> None:
        # Called again by the first attempt: a stream made now but iterated later starts its clock then.
        self.started_at = self.clock()
        self.deadline_at = math.inf if self.timeouts.total_s is None else self.started_at + self.timeouts.total_s

    @property
    def request_id(self) -> str:
        """The server's ``X-Request-ID`` once it answered, else the one sent."""
        if self.reply is not None:
            return self.reply.header("x-request-id") or self.spec.request_id
        return self.spec.request_id

    def mark_first_token(self) -> None:
        """From now on the stall limit, not the first-token limit, bounds each read."""
        self._first_token_seen = True

    @asynccontextmanager
    async def attempt(self) -> AsyncIterator[Reply]:
        """Send one attempt; yields the accepted reply with its body unread, closes it afterwards.

        Raises an ``APIStatusError`` subclass for an error status and the matching
        ``EmberClientError`` for transport failures and timeouts.
        """
        if self.attempts == 0:
            self._start()
        self.attempts += 1
        self._first_token_seen = False
        self._attempt_started_at = self.clock()
        self.base_url = url = self.endpoints.pick()
        self.reply = None
        async with self.transport.send(self, url, self._attempt_headers()) as reply:
            self.endpoints.mark_ok(url)
            self.reply = reply
            yield reply

    def chunks(self, reply: Reply) -> AsyncIterator[dict[str, Any]]:
        """The reply's OpenAI chunk dicts until the end of the answer.

        Raises ``StreamError`` for an error the server reported mid-stream and
        ``APIConnectionError`` when the stream ended before it was complete.
        """
        return self.transport.chunks(self, reply)

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

    async def within_budget(self, awaitable: Awaitable[T]) -> T:
        """Await one step of an attempt under the current time limit, translating the transport's failures."""
        budget_s, timeout_kind, timeout_message = self._budget()
        try:
            return await asyncio.wait_for(awaitable, timeout=None if budget_s == math.inf else max(budget_s, 0.0))
        except TimeoutError:
            raise self.error(timeout_kind, timeout_message) from None
        except Exception as exc:
            translated = self.transport.translate(self, exc)
            if translated is None:
                raise
            raise translated from exc

    def status_error(self, status_code: int, body: Any, headers: Mapping[str, str]) -> APIStatusError:
        """The error for an error status (gRPC statuses arrive as their HTTP equivalent); starts failover on 503."""
        if status_code in self.endpoints.failover_statuses:
            self.endpoints.mark_failed(self.base_url)
        error_class = status_error_class(status_code)
        return error_class(
            error_message(body, f"HTTP {status_code}"),
            status_code=status_code,
            body=body,
            request_id=headers.get("x-request-id") or self.spec.request_id,
            attempts=self.attempts,
            base_url=self.base_url,
            retry_after_s=parse_retry_after(headers),
            should_retry=parse_should_retry(headers),
        )

    def error(self, kind: type[EmberClientError], message: str, **fields: Any) -> EmberClientError:
        """An error of ``kind`` carrying this call's request id, attempt count and base URL."""
        return kind(message, request_id=self.request_id, attempts=self.attempts, base_url=self.base_url, **fields)
