"""When to retry and how long to wait: ``RetryPolicy`` and pure helper functions.

Nothing here sleeps or reads a real clock unless asked to: the random source and
the wall clock are parameters, so tests pin them.
"""

from __future__ import annotations

import datetime
import email.utils
import math
import random as _random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

RETRYABLE_STATUS_CODES: frozenset[int] = frozenset({408, 429, 500, 502, 503, 504})


@dataclass(frozen=True)
class RetryPolicy:
    """How a call retries after a failed attempt.

    The delay before retry ``n`` (1-based) is
    ``min(initial_backoff_s * multiplier ** (n - 1), max_backoff_s)``, then shrunk
    by a random fraction of at most ``jitter_ratio`` so that clients which failed
    together do not come back together. Jitter only ever shortens the delay, so
    ``max_backoff_s`` is a true cap.

    A server's ``Retry-After`` / ``retry-after-ms`` replaces that delay (capped at
    ``max_retry_after_s``), and its ``x-should-retry: true|false`` overrides the
    ``retry_statuses`` rule. ``retry_connection_errors`` covers refused, reset
    and timed-out connects and streams that broke off; the first-token, stall
    and deadline timeouts are never retried (the server may still be working on
    the request). A stream is never retried once text has reached the caller,
    whatever the policy says.
    """

    max_retries: int = 3
    initial_backoff_s: float = 1.0
    max_backoff_s: float = 10.0
    multiplier: float = 2.0
    jitter_ratio: float = 0.25
    max_retry_after_s: float = 120.0
    retry_statuses: frozenset[int] = RETRYABLE_STATUS_CODES
    retry_connection_errors: bool = True
    honour_retry_after: bool = True
    honour_should_retry: bool = True

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.initial_backoff_s < 0 or self.max_backoff_s < 0 or self.max_retry_after_s < 0:
            raise ValueError("backoff times must be >= 0 seconds")
        if self.multiplier < 1:
            raise ValueError(f"multiplier must be >= 1, got {self.multiplier}")
        if not 0 <= self.jitter_ratio <= 1:
            raise ValueError(f"jitter_ratio must be within [0, 1], got {self.jitter_ratio}")


NO_RETRIES = RetryPolicy(max_retries=0)


def backoff_delay(
    policy: RetryPolicy,
    retry_number: int,
    *,
    retry_after_s: float | None = None,
    random: Callable[[], float] = _random.random,
) -> float:
    """Seconds to wait before retry number ``retry_number`` (1 for the first retry).

    ``retry_after_s`` is the server's hint (see ``parse_retry_after``); when the
    policy honours it, it wins over the exponential schedule. ``random`` returns a
    float in [0, 1).
    """
    if retry_number < 1:
        raise ValueError(f"retry_number starts at 1, got {retry_number}")
    if retry_after_s is not None and policy.honour_retry_after:
        return min(max(retry_after_s, 0.0), policy.max_retry_after_s)
    exponent = retry_number - 1
    # Compare in log space first: multiplier ** exponent overflows long before any cap matters.
    base_s = policy.max_backoff_s
    if exponent < 64:
        base_s = min(policy.initial_backoff_s * policy.multiplier**exponent, policy.max_backoff_s)
    return base_s * (1.0 - policy.jitter_ratio * random())


def parse_retry_after(
    headers: Mapping[str, str],
    *,
    now: Callable[[], float] = time.time,
) -> float | None:
    """The server's retry hint in seconds, or None when absent or unreadable.

    ``retry-after-ms`` (milliseconds) is preferred because it is more precise;
    ``Retry-After`` may hold seconds or an HTTP date, which is measured against
    ``now()`` (wall-clock epoch seconds). A date in the past gives 0. The caller
    applies the policy's cap (``backoff_delay``).
    """
    milliseconds = _to_seconds(_header(headers, "retry-after-ms"), scale=0.001)
    if milliseconds is not None:
        return milliseconds
    value = _header(headers, "retry-after")
    if value is None:
        return None
    seconds = _to_seconds(value, scale=1.0)
    if seconds is not None:
        return seconds
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # "-0000" parses unzoned; HTTP dates are always GMT
        when = when.replace(tzinfo=datetime.UTC)
    return max(when.timestamp() - now(), 0.0)


def parse_should_retry(headers: Mapping[str, str]) -> bool | None:
    """The ``x-should-retry`` header as a bool, or None when absent or neither true nor false."""
    value = _header(headers, "x-should-retry")
    if value is None:
        return None
    value = value.strip().lower()
    if value == "true":
        return True
    if value == "false":
        return False
    return None


def status_is_retryable(policy: RetryPolicy, status_code: int, should_retry: bool | None) -> bool:
    """Whether an error status may be retried: the server's ``x-should-retry`` wins when honoured."""
    if should_retry is not None and policy.honour_should_retry:
        return should_retry
    return status_code in policy.retry_statuses


def _to_seconds(value: str | None, scale: float) -> float | None:
    if value is None:
        return None
    try:
        seconds = float(value) * scale
    except ValueError:
        return None
    # "nan" and "inf" parse as floats but are no usable delay.
    return max(seconds, 0.0) if math.isfinite(seconds) else None


def _header(headers: Mapping[str, str], name: str) -> str | None:
    # httpx.Headers is case-insensitive; a plain dict from a test may not be.
    value = headers.get(name)
    if value is None:
        for key, candidate in headers.items():
            if key.lower() == name:
                return candidate
    return value
