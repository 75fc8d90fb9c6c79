"""Admission control: a bounded, prioritised waiting room in front of the engine.

At most ``max_running`` requests are inside the engine; the rest wait here in
(priority, arrival) order. A request is refused at once, without touching the
engine, when:

* the room is full (``max_queue`` requests or ``max_queued_tokens`` prompt
  tokens) → 429 with ``Retry-After`` from the measured drain rate. A
  higher-priority arrival takes the place of the newest lower-priority waiter
  instead, which is refused the same way;
* its deadline cannot be met from its place in line → 503 with Retry-After;
* it is low priority while the degradation controller sheds load → 429;
* its API key is over its concurrency limit → 429.

A request whose deadline passes while it waits leaves the queue (503).
Every refusal is counted in ``llm_requests_rejected_total{reason, priority}``.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ember.server.errors import APIError

_PRIORITY_NAMES = {0: "high", 1: "normal", 2: "low"}


@dataclass(order=True)
class _Waiter:
    priority: int
    seq: int
    prompt_tokens: int = field(compare=False)
    future: asyncio.Future = field(compare=False)
    key: str | None = field(compare=False, default=None)


class DrainRate:
    """Completions per second, smoothed, from the gaps between finishes (injectable clock)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, half_life_s: float = 10.0, initial_per_s: float = 1.0) -> None:
        self.clock = clock
        self.half_life_s = half_life_s
        self.rate = initial_per_s
        self.samples = 0
        self._last = clock()

    def record_finish(self) -> None:
        now = self.clock()
        gap = max(now - self._last, 1e-3)
        self._last = now
        weight = 1 - 0.5 ** (gap / self.half_life_s)
        self.rate = (1 - weight) * self.rate + weight * (1.0 / gap)
        self.samples += 1

    @property
    def measured(self) -> bool:
        """Enough finishes seen for the rate to mean something (before: no deadline refusals)."""
        return self.samples >= 8

    def seconds_for(self, requests: int) -> float:
        return requests / max(self.rate, 1e-3)


class Admission:
    """The waiting room; ``admit`` returns when the request may enter the engine."""

    def __init__(
        self,
        max_running: int,
        max_queue: int,
        max_queued_tokens: int,
        *,
        per_key_concurrency: int = 0,
        clock: Callable[[], float] = time.monotonic,
        on_reject: Callable[[str, int], None] | None = None,
        shed_low: Callable[[int], bool] | None = None,
        on_depth: Callable[[int], None] | None = None,
    ) -> None:
        """``on_depth(n)`` hears the number of waiters whenever it changes
        (the degradation controller watches for a queue that never drains)."""
        self.max_running = max_running
        self.max_queue = max_queue
        self.max_queued_tokens = max_queued_tokens
        self.per_key_concurrency = per_key_concurrency
        self.clock = clock
        self.drain = DrainRate(clock)
        self._on_reject = on_reject
        self._shed_low = shed_low
        self._on_depth = on_depth
        self._heap: list[_Waiter] = []
        self._seq = itertools.count()
        self.running = 0
        self.queued_tokens = 0
        self._per_key: dict[str, int] = {}

    @property
    def num_waiting(self) -> int:
        return len(self._heap)

    def retry_after_s(self) -> float:
        return max(1.0, math.ceil(self.drain.seconds_for(len(self._heap) + 1)))

    def _reject(self, status: int, reason: str, priority: int, message: str) -> APIError:
        if self._on_reject is not None:
            self._on_reject(reason, priority)
        code = {429: "rate_limit_exceeded", 503: "overloaded"}.get(status, reason)
        kind = "rate_limit_error" if status == 429 else "service_unavailable"
        return APIError(status, message, kind, None, code, {"Retry-After": str(int(self.retry_after_s()))})

    def precheck(self, priority: int, key: str | None = None) -> None:
        """Cheap refusals before the prompt is even tokenized."""
        if self._shed_low is not None and self._shed_low(priority):
            raise self._reject(429, "shed", priority, "The server is degraded and sheds low-priority requests; retry later.")
        if key is not None and self.per_key_concurrency and self._per_key.get(key, 0) >= self.per_key_concurrency:
            raise self._reject(429, "key_concurrency", priority, f"This API key already has {self.per_key_concurrency} requests in flight.")
        if self.running >= self.max_running and len(self._heap) >= self.max_queue and not self._lower_priority_waiting(priority):
            raise self._reject(429, "queue_full", priority, "Too many requests are waiting; retry after the indicated delay.")

    async def admit(self, priority: int, prompt_tokens: int, deadline_in_s: float, key: str | None = None) -> None:
        """Wait for a slot. Raises ``APIError`` (429/503) when the request must not wait."""
        self.precheck(priority, key)
        if self.running < self.max_running and not self._heap:
            self._enter(key)
            return
        if self.queued_tokens + prompt_tokens > self.max_queued_tokens and not self._lower_priority_waiting(priority):
            raise self._reject(429, "queue_tokens", priority, "Too many prompt tokens are waiting; retry after the indicated delay.")
        ahead = sum(1 for w in self._heap if (w.priority, w.seq) <= (priority, math.inf))
        if self.drain.measured and self.drain.seconds_for(ahead + 1) > deadline_in_s:
            raise self._reject(
                503, "deadline", priority, f"The request cannot start within its {deadline_in_s:.1f}s deadline from its place in line."
            )
        if len(self._heap) >= self.max_queue or self.queued_tokens + prompt_tokens > self.max_queued_tokens:
            self._evict_lowest(priority)
        waiter = _Waiter(priority, next(self._seq), prompt_tokens, asyncio.get_running_loop().create_future(), key)
        heapq.heappush(self._heap, waiter)
        self.queued_tokens += prompt_tokens
        self._depth_changed()
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), timeout=max(deadline_in_s, 0.0))
        except TimeoutError:
            if self._remove(waiter):
                raise self._reject(503, "queue_timeout", priority, "The request's deadline passed while it waited in the queue.") from None
            # Granted at the same instant: the slot is ours; keep it.
        except APIError:
            raise  # displaced by a higher priority: it never held a slot
        except BaseException:
            if not self._remove(waiter) and _granted(waiter.future):
                self.release(key)  # granted, then the client left: give the slot back
            raise

    def release(self, key: str | None = None) -> None:
        """A request left the engine: count the finish and let the next waiter in."""
        self.running -= 1
        if key is not None and key in self._per_key:
            self._per_key[key] -= 1
            if self._per_key[key] <= 0:
                del self._per_key[key]
        self.drain.record_finish()
        self._wake()

    def _enter(self, key: str | None) -> None:
        self.running += 1
        if key is not None:
            self._per_key[key] = self._per_key.get(key, 0) + 1

    def _wake(self) -> None:
        woke = False
        while self._heap and self.running < self.max_running:
            waiter = heapq.heappop(self._heap)
            self.queued_tokens -= waiter.prompt_tokens
            woke = True
            if waiter.future.done():
                continue
            self._enter(waiter.key)
            waiter.future.set_result(None)
        if woke:
            self._depth_changed()

    def _remove(self, waiter: _Waiter) -> bool:
        if waiter in self._heap:
            self._heap.remove(waiter)
            heapq.heapify(self._heap)
            self.queued_tokens -= waiter.prompt_tokens
            self._depth_changed()
            return True
        return False

    def _depth_changed(self) -> None:
        if self._on_depth is not None:
            self._on_depth(len(self._heap))

    def _lower_priority_waiting(self, priority: int) -> bool:
        return any(w.priority > priority for w in self._heap)

    def _evict_lowest(self, priority: int) -> None:
        """Refuse the newest waiter of the lowest priority below ``priority``, to make room."""
        victims = [w for w in self._heap if w.priority > priority]
        if not victims:
            return
        victim = max(victims, key=lambda w: (w.priority, w.seq))
        self._remove(victim)
        victim.future.set_exception(
            self._reject(429, "displaced", victim.priority, "A higher-priority request took this place in the queue; retry later.")
        )


def _granted(future: asyncio.Future) -> bool:
    return future.done() and not future.cancelled() and future.exception() is None
