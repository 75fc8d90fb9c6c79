"""Failover across several base URLs, with a cool-down for the ones that failed.

This is failover, not load balancing (the router balances): the URLs are in
order of preference, and every call starts at the most preferred one that is
not cooling down. A URL that answered 503 or could not be reached cools down
for ``cooldown_s`` and is tried again after that.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

# Statuses that mean "this backend cannot serve now, another one may".
FAILOVER_STATUS_CODES: frozenset[int] = frozenset({503})


class Endpoints:
    """The base URLs of one client and which of them are cooling down.

    Invariant: ``_cooling_until`` only holds URLs of ``base_urls``; a URL absent
    from it (or whose time has passed) is available. Not thread-safe: a client
    uses it from its event loop only.
    """

    def __init__(
        self,
        base_urls: Sequence[str],
        *,
        cooldown_s: float = 30.0,
        failover_statuses: frozenset[int] = FAILOVER_STATUS_CODES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not base_urls:
            raise ValueError("at least one base URL is required")
        if cooldown_s < 0:
            raise ValueError(f"cooldown_s must be >= 0, got {cooldown_s}")
        self.base_urls: tuple[str, ...] = tuple(url.rstrip("/") for url in base_urls)
        if len(set(self.base_urls)) != len(self.base_urls):
            raise ValueError(f"duplicate base URLs: {list(self.base_urls)}")
        self.cooldown_s = cooldown_s
        self.failover_statuses = failover_statuses
        self._clock = clock
        self._cooling_until: dict[str, float] = {}

    def pick(self) -> str:
        """The most preferred available URL; if all cool down, the one that recovers first."""
        now = self._clock()
        for url in self.base_urls:
            if self._cooling_until.get(url, now) <= now:
                return url
        return min(self.base_urls, key=lambda url: self._cooling_until[url])

    def is_available(self, url: str) -> bool:
        """True when ``url`` is not cooling down."""
        return self._cooling_until.get(url, 0.0) <= self._clock()

    def mark_failed(self, url: str) -> None:
        """Start (or restart) ``url``'s cool-down."""
        if len(self.base_urls) > 1:  # with one URL there is nowhere else to go
            self._cooling_until[url] = self._clock() + self.cooldown_s

    def mark_ok(self, url: str) -> None:
        """``url`` answered: end its cool-down early."""
        self._cooling_until.pop(url, None)

    def can_fail_over_from(self, url: str) -> bool:
        """True when another URL than ``url`` is available right now."""
        return any(other != url and self.is_available(other) for other in self.base_urls)
