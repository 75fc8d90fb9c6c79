"""Unit tests of ember.client.retry: the backoff schedule and the server's retry hints."""

from __future__ import annotations

import email.utils
import random

import pytest

from ember.client.retry import (
    RETRYABLE_STATUS_CODES,
    RetryPolicy,
    backoff_delay,
    parse_retry_after,
    parse_should_retry,
    status_is_retryable,
)

pytestmark = pytest.mark.timeout(10)

NOW = 1_700_000_000.0  # a fixed wall clock for HTTP-date hints


def no_jitter() -> float:
    return 0.0


def test_defaults_match_the_documented_policy() -> None:
    policy = RetryPolicy()
    assert policy.max_retries == 3
    assert policy.initial_backoff_s == 1.0
    assert policy.max_backoff_s == 10.0
    assert policy.max_retry_after_s == 120.0
    assert policy.retry_statuses == frozenset({408, 429, 500, 502, 503, 504}) == RETRYABLE_STATUS_CODES


def test_backoff_doubles_from_one_second_until_the_cap() -> None:
    policy = RetryPolicy()
    delays = [backoff_delay(policy, n, random=no_jitter) for n in range(1, 8)]
    assert delays == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0]


def test_backoff_honours_custom_knobs() -> None:
    policy = RetryPolicy(initial_backoff_s=0.1, multiplier=3.0, max_backoff_s=1.0)
    delays = [backoff_delay(policy, n, random=no_jitter) for n in range(1, 5)]
    assert delays == pytest.approx([0.1, 0.3, 0.9, 1.0])


def test_backoff_of_a_huge_retry_number_stays_at_the_cap() -> None:
    assert backoff_delay(RetryPolicy(), 10_000, random=no_jitter) == 10.0


@pytest.mark.parametrize("draw", [0.0, 0.3, 0.5, 0.999999])
def test_jitter_shrinks_the_delay_by_at_most_the_ratio(draw: float) -> None:
    policy = RetryPolicy(jitter_ratio=0.25)
    assert backoff_delay(policy, 3, random=lambda: draw) == pytest.approx(4.0 * (1 - 0.25 * draw))


def test_jittered_delays_stay_within_bounds_and_vary() -> None:
    policy = RetryPolicy()
    rng = random.Random(1234)
    delays = [backoff_delay(policy, 5, random=rng.random) for _ in range(200)]
    assert all(7.5 <= d <= 10.0 for d in delays)  # never above the cap, never below cap * (1 - 0.25)
    assert max(delays) - min(delays) > 1.0  # jitter actually spreads clients out


def test_zero_jitter_ratio_gives_exact_delays() -> None:
    policy = RetryPolicy(jitter_ratio=0.0)
    assert backoff_delay(policy, 2, random=lambda: 0.9) == 2.0


def test_retry_after_replaces_the_schedule_and_is_capped() -> None:
    policy = RetryPolicy()
    assert backoff_delay(policy, 1, retry_after_s=0.2, random=lambda: 0.9) == 0.2
    assert backoff_delay(policy, 1, retry_after_s=30.0) == 30.0  # longer than max_backoff_s is allowed
    assert backoff_delay(policy, 1, retry_after_s=500.0) == 120.0
    assert backoff_delay(RetryPolicy(max_retry_after_s=5.0), 1, retry_after_s=60.0) == 5.0


def test_retry_after_is_ignored_when_the_policy_says_so() -> None:
    policy = RetryPolicy(honour_retry_after=False)
    assert backoff_delay(policy, 2, retry_after_s=0.2, random=no_jitter) == 2.0


def test_retry_numbers_start_at_one() -> None:
    with pytest.raises(ValueError):
        backoff_delay(RetryPolicy(), 0)


@pytest.mark.parametrize(
    "kwargs",
    [{"max_retries": -1}, {"initial_backoff_s": -1.0}, {"multiplier": 0.5}, {"jitter_ratio": 1.5}],
)
def test_policy_rejects_nonsense(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(**kwargs)


def test_policy_is_frozen() -> None:
    with pytest.raises(AttributeError):
        RetryPolicy().max_retries = 5  # type: ignore[misc]


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"Retry-After": "2"}, 2.0),
        ({"retry-after": "0.5"}, 0.5),
        ({"RETRY-AFTER": "0"}, 0.0),
        ({"retry-after-ms": "250"}, 0.25),
        ({"retry-after-ms": "250", "retry-after": "9"}, 0.25),  # the precise hint wins
        ({"retry-after-ms": "soon", "retry-after": "9"}, 9.0),  # an unreadable ms hint falls back
        ({"retry-after": "-3"}, 0.0),
        ({}, None),
        ({"retry-after": "tomorrow-ish"}, None),
        ({"retry-after": "nan"}, None),
        ({"retry-after-ms": "inf"}, None),
    ],
)
def test_parse_retry_after(headers: dict, expected: float | None) -> None:
    assert parse_retry_after(headers, now=lambda: NOW) == expected


def test_parse_retry_after_http_date() -> None:
    future = email.utils.formatdate(NOW + 30, usegmt=True)  # e.g. "Tue, 14 Nov 2023 22:13:50 GMT"
    assert parse_retry_after({"Retry-After": future}, now=lambda: NOW) == pytest.approx(30.0)
    past = email.utils.formatdate(NOW - 30, usegmt=True)
    assert parse_retry_after({"Retry-After": past}, now=lambda: NOW) == 0.0
    unzoned = email.utils.formatdate(NOW + 10).rsplit(" ", 1)[0] + " -0000"
    assert parse_retry_after({"Retry-After": unzoned}, now=lambda: NOW) == pytest.approx(10.0)


def test_a_far_http_date_is_capped_by_the_policy_not_the_parser() -> None:
    far = email.utils.formatdate(NOW + 3600, usegmt=True)
    hint = parse_retry_after({"Retry-After": far}, now=lambda: NOW)
    assert hint == pytest.approx(3600.0)
    assert backoff_delay(RetryPolicy(), 1, retry_after_s=hint) == 120.0


@pytest.mark.parametrize(
    ("value", "expected"),
    [("true", True), ("TRUE", True), (" false ", False), ("maybe", None), (None, None)],
)
def test_parse_should_retry(value: str | None, expected: bool | None) -> None:
    headers = {} if value is None else {"X-Should-Retry": value}
    assert parse_should_retry(headers) is expected


def test_status_rule_and_its_header_override() -> None:
    policy = RetryPolicy()
    assert [s for s in (400, 401, 404, 408, 409, 429, 500, 501, 502, 503, 504) if status_is_retryable(policy, s, None)] == [
        408, 429, 500, 502, 503, 504,
    ]  # fmt: skip
    assert status_is_retryable(policy, 400, True)
    assert not status_is_retryable(policy, 503, False)
    deaf = RetryPolicy(honour_should_retry=False)
    assert not status_is_retryable(deaf, 400, True)
    assert status_is_retryable(deaf, 503, False)
