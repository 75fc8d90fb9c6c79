"""Giving the pages of freed warm copies back to the system (glibc's ``malloc_trim``).

A warm conversation's packed KV is a few MB that malloc serves from its heap
(glibc raises its mmap threshold to the size of the largest block freed, up to
32 MB, so after the first free these no longer get their own mapping). When
the warm tier is full, every new warm copy evicts an older one: the freed
copies leave holes among live ones that glibc keeps resident. Measured on the
soak (`python -m benchmarks soak`, warm tier at its 1 GB budget): malloc's
bytes in use flat, its free-but-held bytes +4.5 MB/min, which was the RSS
slope. ``malloc_trim(0)`` returns every whole free page inside the heap, not
only its top.

The rule (``HeapTrimmer.freed``): trim once at least ``threshold_bytes`` of
warm copies were dropped since the last trim and ``min_interval_s`` passed,
so a steady eviction rate costs one trim every so often, never one per copy.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ember import malloc_heap

log = logging.getLogger("ember.engine")

TRIM_THRESHOLD_BYTES = 64 * 1024 * 1024
TRIM_MIN_INTERVAL_S = 10.0


class HeapTrimmer:
    """Counts the bytes of dropped warm copies and trims when the rule in the module docstring says so."""

    def __init__(
        self,
        threshold_bytes: int = TRIM_THRESHOLD_BYTES,
        min_interval_s: float = TRIM_MIN_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        do_trim: Callable[[], bool] = malloc_heap.trim,
    ) -> None:
        self.threshold_bytes, self.min_interval_s, self.clock, self.do_trim = threshold_bytes, min_interval_s, clock, do_trim
        self.pending_bytes = 0
        self.trims = 0
        self._last = float("-inf")

    def freed(self, nbytes: int) -> bool:
        """``nbytes`` of a warm copy were just dropped; True if this call trimmed."""
        self.pending_bytes += nbytes
        now = self.clock()
        if self.pending_bytes < self.threshold_bytes or now - self._last < self.min_interval_s:
            return False
        started = time.perf_counter()
        if not self.do_trim():
            self.pending_bytes = 0
            return False
        self.pending_bytes, self._last, self.trims = 0, now, self.trims + 1
        log.debug("malloc_trim after dropping warm copies: %.1f ms", 1000 * (time.perf_counter() - started))
        return True
