"""Circuit breaker transitions, driven by a hand-moved clock."""

from __future__ import annotations

import pytest

from ember.router.breaker import BreakerState, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(threshold: int = 3, open_s: float = 10.0) -> tuple[CircuitBreaker, Clock, list[tuple[str, str]]]:
    clock = Clock()
    changes: list[tuple[str, str]] = []
    breaker = CircuitBreaker(
        threshold, open_s, clock, on_change=lambda old, new: changes.append((old.value, new.value))
    )
    return breaker, clock, changes


@pytest.mark.timeout(5)
def test_opens_after_consecutive_failures_only() -> None:
    breaker, _, changes = make(threshold=3)
    breaker.record_failure()
    breaker.record_failure()
    breaker.record_success()  # resets the streak
    breaker.record_failure()
    breaker.record_failure()
    assert breaker.state is BreakerState.CLOSED and breaker.try_acquire()
    breaker.record_failure()
    assert breaker.state is BreakerState.OPEN
    assert not breaker.allows_request() and not breaker.try_acquire()
    assert changes == [("closed", "open")]


@pytest.mark.timeout(5)
def test_half_open_allows_exactly_one_trial_and_success_closes() -> None:
    breaker, clock, changes = make(threshold=1, open_s=10.0)
    breaker.record_failure()
    clock.now = 9.99
    assert breaker.state is BreakerState.OPEN
    clock.now = 10.0
    assert breaker.state is BreakerState.HALF_OPEN and breaker.allows_request()
    assert breaker.try_acquire()
    assert not breaker.allows_request() and not breaker.try_acquire()  # the trial is in flight
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED and breaker.consecutive_failures == 0
    assert changes == [("closed", "open"), ("half_open", "closed")]


@pytest.mark.timeout(5)
def test_failed_trial_reopens_for_a_full_open_period() -> None:
    breaker, clock, _ = make(threshold=2, open_s=5.0)
    breaker.record_failure()
    breaker.record_failure()
    clock.now = 5.0
    assert breaker.try_acquire()
    breaker.record_failure()
    assert breaker.state is BreakerState.OPEN
    clock.now = 9.9
    assert breaker.state is BreakerState.OPEN
    clock.now = 10.0
    assert breaker.state is BreakerState.HALF_OPEN


@pytest.mark.timeout(5)
def test_released_trial_frees_the_slot_without_a_verdict() -> None:
    breaker, clock, _ = make(threshold=1, open_s=1.0)
    breaker.record_failure()
    clock.now = 1.0
    assert breaker.try_acquire()
    breaker.release()
    assert breaker.state is BreakerState.HALF_OPEN and breaker.try_acquire()


@pytest.mark.timeout(5)
def test_results_while_open_do_not_change_the_open_period() -> None:
    breaker, clock, _ = make(threshold=1, open_s=10.0)
    breaker.record_failure()
    clock.now = 5.0
    breaker.record_failure()  # a late failure of a request sent before it opened
    breaker.record_success()  # and a late success
    assert breaker.state is BreakerState.OPEN
    clock.now = 10.0
    assert breaker.state is BreakerState.HALF_OPEN
