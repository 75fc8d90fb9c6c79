"""A per-replica circuit breaker: stop sending traffic to a replica that keeps failing.

States and transitions (the invariant every method keeps):

- ``closed``: requests flow; ``consecutive_failures < failure_threshold``.
  A success resets the count; reaching the threshold opens the breaker.
- ``open``: no request is sent until ``open_s`` has passed since it opened.
- ``half_open``: the open time is over; exactly one trial request may be in
  flight. Its success closes the breaker, its failure opens it for another
  ``open_s``. If the trial ends without a verdict (the client went away),
  the slot is released for the next trial.

The clock is injected, so tests move time by hand instead of sleeping.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable


class BreakerState(str, enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """Consecutive-failure circuit breaker with a single half-open trial."""

    def __init__(
        self,
        failure_threshold: int,
        open_s: float,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[BreakerState, BreakerState], None] | None = None,
    ) -> None:
        self.failure_threshold = failure_threshold
        self.open_s = open_s
        self.consecutive_failures = 0
        self._clock = clock
        self._on_change = on_change
        self._opened_at: float | None = None  # set iff open or half-open
        self._trial_in_flight = False

    @property
    def state(self) -> BreakerState:
        """The current state; ``open`` turns into ``half_open`` when its time is up."""
        if self._opened_at is None:
            return BreakerState.CLOSED
        if self._clock() - self._opened_at < self.open_s:
            return BreakerState.OPEN
        return BreakerState.HALF_OPEN

    def allows_request(self) -> bool:
        """Whether a request could be sent now (no side effect)."""
        state = self.state
        if state is BreakerState.CLOSED:
            return True
        return state is BreakerState.HALF_OPEN and not self._trial_in_flight

    def try_acquire(self) -> bool:
        """Claim permission to send one request; in ``half_open`` this takes the trial slot."""
        state = self.state
        if state is BreakerState.CLOSED:
            return True
        if state is BreakerState.HALF_OPEN and not self._trial_in_flight:
            self._trial_in_flight = True
            return True
        return False

    def release(self) -> None:
        """An acquired request ended with no verdict on the replica's health."""
        self._trial_in_flight = False

    def record_success(self) -> None:
        """The replica answered well: reset the failure count, close if half-open."""
        self._trial_in_flight = False
        self.consecutive_failures = 0
        state = self.state
        # A late success of a request sent before the breaker opened proves
        # little; only the half-open trial (or later traffic) closes it.
        if state is BreakerState.HALF_OPEN:
            self._opened_at = None
            self._notify(state, BreakerState.CLOSED)

    def record_failure(self) -> None:
        """The replica failed: count it; open at the threshold, reopen if half-open."""
        self._trial_in_flight = False
        state = self.state
        if state is BreakerState.OPEN:
            return
        self.consecutive_failures += 1
        if state is BreakerState.HALF_OPEN or self.consecutive_failures >= self.failure_threshold:
            self._opened_at = self._clock()
            self._notify(state, BreakerState.OPEN)

    def _notify(self, old: BreakerState, new: BreakerState) -> None:
        if self._on_change is not None and old is not new:
            self._on_change(old, new)
