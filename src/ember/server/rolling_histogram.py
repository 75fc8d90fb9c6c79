"""RollingHistogram: bucket counts of the samples of a trailing time window, in fixed memory.

Samples are counted in per-``slot_s`` slots of histogram buckets; slots older
than the window are dropped and running totals kept in step, so ``add`` and
the queries cost O(number of bounds) whatever the sample rate, and memory is
at most ``window_s / slot_s + 1`` slots. Quantiles are estimated the way
Prometheus' ``histogram_quantile`` does; "is p99 above this objective" is
decided exactly when the objective is one of the bounds (the degradation
controller adds its objectives to the bounds for that reason).

No clock inside: every call takes ``now``, so tests drive time by hand.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass
class _Slot:
    start: float
    counts: list[int]


class RollingHistogram:
    """Bucketed samples of the last ``window_s`` seconds (at ``slot_s`` resolution)."""

    def __init__(self, bounds: Iterable[float], window_s: float, slot_s: float = 1.0) -> None:
        if window_s <= 0 or not 0 < slot_s <= window_s:
            raise ValueError("window_s must be positive and slot_s in (0, window_s]")
        self.bounds: list[float] = sorted(set(bounds))
        self.window_s = window_s
        self.slot_s = slot_s
        self._slots: deque[_Slot] = deque()
        # Invariant: the element-wise sum of the retained slots' counts, and its total.
        self._totals = self._zeros()
        self._n = 0

    def _zeros(self) -> list[int]:
        return [0] * (len(self.bounds) + 1)  # +1: the +Inf bucket

    def add(self, value: float, now: float) -> None:
        """Count one sample observed at ``now``."""
        self.expire(now)
        start = math.floor(now / self.slot_s) * self.slot_s
        if not self._slots or self._slots[-1].start != start:
            self._slots.append(_Slot(start, self._zeros()))
        i = bisect.bisect_left(self.bounds, value)  # first bound >= value: its "le" bucket
        self._slots[-1].counts[i] += 1
        self._totals[i] += 1
        self._n += 1

    def expire(self, now: float) -> None:
        """Drop the slots that ended before the window that ends at ``now``."""
        horizon = now - self.window_s
        while self._slots and self._slots[0].start + self.slot_s <= horizon:
            old = self._slots.popleft()
            for i, c in enumerate(old.counts):
                self._totals[i] -= c
            self._n -= sum(old.counts)

    def count(self, now: float) -> int:
        """Samples in the window."""
        self.expire(now)
        return self._n

    @property
    def retained_slots(self) -> int:
        """Slots held in memory; bounded by ``window_s / slot_s + 1``."""
        return len(self._slots)

    def above(self, objective: float, quantile: float, now: float) -> bool:
        """Whether the ``quantile`` of the window is above ``objective`` (which must be a bound).

        Exact: fewer than ``quantile`` of the samples are <= the objective. An
        empty window is never above.
        """
        self.expire(now)
        index = self.bounds.index(objective)
        return self._n > 0 and sum(self._totals[: index + 1]) < quantile * self._n

    def quantile(self, q: float, now: float) -> float | None:
        """``histogram_quantile(q)`` of the window; None when it is empty.

        Linear interpolation inside the bucket holding the rank; a rank in the
        +Inf bucket reports the highest finite bound.
        """
        self.expire(now)
        if self._n == 0:
            return None
        rank = q * self._n
        cumulative = 0
        for i, count in enumerate(self._totals):
            below = cumulative
            cumulative += count
            if cumulative >= rank and count > 0:
                if i == len(self.bounds):
                    return self.bounds[-1]
                lower = self.bounds[i - 1] if i > 0 else 0.0
                return lower + (self.bounds[i] - lower) * (rank - below) / count
        return self.bounds[-1]
