"""Per-request memory peaks for ``--trace-memory`` that concurrent requests cannot overwrite.

tracemalloc keeps one process-wide peak. Resetting it when a request starts
(what an earlier version did) erases the peak of every request already in
flight, so with two requests at once the first one reported only what came
after the second arrived.

Here the peak is reset only at events (a request begins or ends), and each
reset first folds the peak of the interval that just closed into every
request in flight. Lifetimes begin and end at events, so each interval lies
entirely inside or entirely outside any request's life, and a request's
figure is exactly the highest traced Python memory of the *whole process*
while it was in flight. It is a process-wide figure (Python cannot tell which
request allocated what), and the access log names it so:
``process_peak_python_bytes``. Event-loop thread only.
"""

from __future__ import annotations

import tracemalloc


class _Tracked:
    __slots__ = ("peak",)

    def __init__(self) -> None:
        self.peak = 0


class MemoryPeaks:
    """Hands each request the process's peak traced memory during its life."""

    def __init__(self) -> None:
        if not tracemalloc.is_tracing():
            tracemalloc.start()
        self._active: set[_Tracked] = set()

    def _fold(self) -> None:
        """Close the current interval: credit its peak to every request in flight, then reset."""
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        for tracked in self._active:
            if peak > tracked.peak:
                tracked.peak = peak

    def begin(self) -> _Tracked:
        """A request starts; keep the token for ``end``."""
        self._fold()
        tracked = _Tracked()
        self._active.add(tracked)
        return tracked

    def end(self, tracked: _Tracked) -> int:
        """The request ends: the peak traced bytes of the process while it was in flight."""
        self._fold()
        self._active.discard(tracked)
        return tracked.peak
