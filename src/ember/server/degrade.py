"""Degradation controller: act on overload, and only on overload.

A long answer on an idle server is slow end to end, but nothing is wrong:
clamping everyone's max_tokens because one user asked for 300 tokens would
punish the only user there is. So the controller does not watch end-to-end
latency (the shipped ``HighLLMLatency`` alert keeps the article's rule on
``llm_request_duration_seconds`` for humans). It watches what overload does
first and what a long answer never does:

- **queue wait**: time from a request's arrival (before admission) to its
  first scheduling in the engine; p99 above ``queue_slo_s``;
- **time to first token** (optional, off by default: a long prompt is slow to
  its first token on an idle server too); p99 above ``ttft_slo_s``;
- **inter-token latency**: p99 of the gaps between a stream's tokens above
  ``itl_slo_s`` (running streams are starved);
- **a standing queue**: the admission queue has not been empty once for the
  whole evaluation window, i.e. it never drained.

The rule, like the alert's ``for: 2m``:

- *the condition*: any of the four holds over the trailing **evaluation
  window** (``eval_window_s``, default half of ``window_s``); the p99s need at
  least ``min_samples`` requests (``min_itl_samples`` token gaps) in it;
- *enter*: the condition has held at every evaluation for ``window_s``;
- *leave*: the condition has been false at every evaluation for ``window_s``.

Degraded means: max_tokens clamped to the ``support`` preset, low priority
shed, smaller prefill chunks so running streams keep a steady inter-token
latency.

Pure: the controller is fed samples and reads an injectable clock; it does no
I/O and takes no locks (the server calls it from its event loop only), so the
tests drive it with a fake clock. ``evaluate`` applies the rule; the server
calls it periodically.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ember.config import MAX_TOKENS_PRESETS
from ember.server.metrics import ITL_BUCKETS, LATENCY_BUCKETS
from ember.server.rolling_histogram import RollingHistogram

log = logging.getLogger("ember.server.degrade")

QUANTILE = 0.99
# The ``support`` preset (80): short answers keep every stream, and so the queue, short.
DEFAULT_CLAMP_MAX_TOKENS = MAX_TOKENS_PRESETS["support"]
# A quarter of the default step budget: a long prompt then delays running streams far less.
DEFAULT_DEGRADED_CHUNK_TOKENS = 128
# Below this many requests in the evaluation window a p99 is noise: one slow
# request among a handful must not degrade the whole server.
DEFAULT_MIN_SAMPLES = 20
# Token gaps come by the hundred per request; a p99 of fewer is one hiccup.
DEFAULT_MIN_ITL_SAMPLES = 100
# Priority values as in engine.request.Priority (0 high, 1 normal, 2 low); kept
# as a plain int so this module stays free of engine imports.
LOW_PRIORITY = 2
# "No cap" for max_tokens_cap(): larger than any real limit, so min() keeps the other one.
NO_CAP = sys.maxsize


@dataclass
class _Timers:
    """Since when the condition has held at every evaluation (``over_since``),
    or has failed at every evaluation (``under_since``). Exactly one is set
    once the rule has been evaluated; both are None before that.
    """

    over_since: float | None = None
    under_since: float | None = None


class DegradationController:
    """Decides when the server runs degraded, and what degraded means for a request.

    ``on_change(degraded, reason)`` is called on every change of the effective
    state (automatic or forced); the server logs it and sets ``llm_degraded``.
    """

    def __init__(
        self,
        queue_slo_s: float,
        itl_slo_s: float,
        window_s: float,
        eval_window_s: float | None = None,
        ttft_slo_s: float | None = None,
        clamp_max_tokens: int = DEFAULT_CLAMP_MAX_TOKENS,
        degraded_chunk_tokens: int = DEFAULT_DEGRADED_CHUNK_TOKENS,
        min_samples: int = DEFAULT_MIN_SAMPLES,
        min_itl_samples: int = DEFAULT_MIN_ITL_SAMPLES,
        slot_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[bool, str], None] | None = None,
    ) -> None:
        """Set up an automatic (not forced), non-degraded controller.

        ``eval_window_s`` defaults to ``window_s / 2`` and must be shorter than
        ``window_s`` (otherwise a single burst could hold a p99 up for a whole
        window). ``slot_s``, the resolution of the trailing window, defaults to
        a twentieth of it, at most 1 s.
        """
        if queue_slo_s <= 0 or itl_slo_s <= 0 or window_s <= 0:
            raise ValueError("queue_slo_s, itl_slo_s and window_s must be positive")
        if ttft_slo_s is not None and ttft_slo_s <= 0:
            raise ValueError("ttft_slo_s must be positive")
        eval_window_s = window_s / 2 if eval_window_s is None else eval_window_s
        if not 0 < eval_window_s < window_s:
            raise ValueError("eval_window_s must be positive and shorter than window_s")
        slot_s = min(1.0, eval_window_s / 20) if slot_s is None else slot_s
        if slot_s <= 0 or slot_s > eval_window_s:
            raise ValueError("slot_s must be positive and at most eval_window_s")
        if min(clamp_max_tokens, degraded_chunk_tokens, min_samples, min_itl_samples) < 1:
            raise ValueError("clamp_max_tokens, degraded_chunk_tokens, min_samples and min_itl_samples must be >= 1")
        self.queue_slo_s = queue_slo_s
        self.itl_slo_s = itl_slo_s
        self.ttft_slo_s = ttft_slo_s
        self.window_s = window_s
        self.eval_window_s = eval_window_s
        self.clamp_max_tokens = clamp_max_tokens
        self.degraded_chunk_tokens = degraded_chunk_tokens
        self.min_samples = min_samples
        self.min_itl_samples = min_itl_samples
        latency_bounds = set(LATENCY_BUCKETS) | {queue_slo_s} | ({ttft_slo_s} if ttft_slo_s else set())
        self._queue = RollingHistogram(latency_bounds, eval_window_s, slot_s)
        self._ttft = RollingHistogram(latency_bounds, eval_window_s, slot_s)
        self._itl = RollingHistogram(set(ITL_BUCKETS) | {itl_slo_s}, eval_window_s, slot_s)
        # Reported in the snapshot, never acted on: what the end-to-end rule would have seen.
        self._e2e = RollingHistogram(LATENCY_BUCKETS, eval_window_s, slot_s)
        self._clock = clock
        self._on_change = on_change
        self._queue_depth = 0
        self._nonempty_since: float | None = None
        self._timers = _Timers()
        self._auto_degraded = False
        self._forced: bool | None = None
        self._since: float | None = None
        self._reason = ""

    # ------------------------------------------------------------------ inputs

    def observe_start(self, queue_s: float, ttft_s: float | None = None) -> None:
        """A request was first scheduled after waiting ``queue_s`` since its arrival.

        ``ttft_s`` (also from arrival) when its first token came with it. A
        request whose deadline passed while it waited is reported here too,
        with the time it waited.
        """
        now = self._clock()
        self._queue.add(queue_s, now)
        if ttft_s is not None:
            self._ttft.add(ttft_s, now)

    def observe_itl(self, gap_s: float) -> None:
        """One gap between two consecutive outputs of a stream."""
        self._itl.add(gap_s, self._clock())

    def observe_e2e(self, e2e_s: float) -> None:
        """A finished request's end-to-end latency: reported, not acted on."""
        self._e2e.add(e2e_s, self._clock())

    def queue_depth(self, depth: int) -> None:
        """The admission queue's length, reported on every change."""
        now = self._clock()
        if depth <= 0:
            self._nonempty_since = None
        elif self._nonempty_since is None:
            self._nonempty_since = now
        self._queue_depth = max(depth, 0)

    def evaluate(self) -> None:
        """Apply the rule at the current time: a state flips only after the
        opposite condition has held at every evaluation for ``window_s``.

        The server calls this periodically, so the controller also moves when
        no request arrives, e.g. leaves once traffic stops.
        """
        now = self._clock()
        over, detail = self._condition(now)
        t = self._timers
        if over:
            t.under_since = None
            if t.over_since is None:
                t.over_since = now
        else:
            t.over_since = None
            if t.under_since is None:
                t.under_since = now
        if not self._auto_degraded and t.over_since is not None and now - t.over_since >= self.window_s:
            self._set_auto(True, f"{detail} for {now - t.over_since:.0f}s")
        elif self._auto_degraded and t.under_since is not None and now - t.under_since >= self.window_s:
            self._set_auto(False, f"{detail} for {now - t.under_since:.0f}s")

    def force(self, state: bool | None) -> None:
        """Force degraded mode on (True) or off (False); None returns to automatic.

        The automatic rule keeps tracking while forced, so returning to
        automatic resumes from the current automatic state.
        """
        before = self.degraded
        self._forced = state
        if state is None:
            reason = "automatic control resumed"
        else:
            reason = f"forced {'on' if state else 'off'} by an administrator"
        self._changed(before, reason)

    # ----------------------------------------------------------------- outputs

    @property
    def degraded(self) -> bool:
        """The effective state: the forced one if forced, else the automatic one."""
        return self._auto_degraded if self._forced is None else self._forced

    @property
    def forced(self) -> bool | None:
        """True / False while forced on / off; None under automatic control."""
        return self._forced

    @property
    def retained_slots(self) -> int:
        """Time slots held in memory by the busiest window (token gaps)."""
        return max(h.retained_slots for h in (self._queue, self._ttft, self._itl, self._e2e))

    def max_tokens_cap(self) -> int:
        """The largest max_tokens a new request may run with (``NO_CAP`` when not degraded)."""
        return self.clamp_max_tokens if self.degraded else NO_CAP

    def should_shed(self, priority: int) -> bool:
        """Whether to refuse a new request of this priority (0 high, 1 normal, 2 low).

        Only low priority is shed, and only while degraded.
        """
        return self.degraded and priority >= LOW_PRIORITY

    def prefill_chunk_tokens(self, normal: int) -> int:
        """The per-step prefill token budget to use instead of ``normal``."""
        return min(normal, self.degraded_chunk_tokens) if self.degraded else normal

    def snapshot(self) -> dict[str, Any]:
        """State for ``/health`` and ``/admin/degrade``.

        p99s are estimated from the buckets like ``histogram_quantile``, over
        the evaluation window (None with no samples); ``p99_e2e_s`` is shown
        for comparison with the alert, and never acted on. ``since`` is the
        controller clock's reading at the last change (None if it never
        changed) and ``seconds_in_state`` how long ago that was.
        """
        now = self._clock()
        return {
            "degraded": self.degraded,
            "forced": self._forced,
            "p99_queue_s": _rounded(self._queue.quantile(QUANTILE, now)),
            "p99_ttft_s": _rounded(self._ttft.quantile(QUANTILE, now)),
            "p99_itl_s": _rounded(self._itl.quantile(QUANTILE, now)),
            "p99_e2e_s": _rounded(self._e2e.quantile(QUANTILE, now)),
            "samples": self._queue.count(now),
            "itl_samples": self._itl.count(now),
            "queue_depth": self._queue_depth,
            "queue_nonempty_s": None if self._nonempty_since is None else round(now - self._nonempty_since, 3),
            "queue_slo_s": self.queue_slo_s,
            "ttft_slo_s": self.ttft_slo_s,
            "itl_slo_s": self.itl_slo_s,
            "window_s": self.window_s,
            "eval_window_s": self.eval_window_s,
            "since": self._since,
            "seconds_in_state": None if self._since is None else round(now - self._since, 3),
            "reason": self._reason,
        }

    # ---------------------------------------------------------------- the rule

    def _condition(self, now: float) -> tuple[bool, str]:
        """Whether any overload signal holds over the evaluation window, and which.

        Too few samples count as "not above": a quiet server cannot trigger,
        and a server whose traffic stopped recovers instead of staying
        degraded forever.
        """
        if self._queue.count(now) >= self.min_samples and self._queue.above(self.queue_slo_s, QUANTILE, now):
            return True, f"p99 queue wait {self._queue.quantile(QUANTILE, now):.2f}s > {self.queue_slo_s:g}s"
        if self.ttft_slo_s is not None and self._ttft.count(now) >= self.min_samples and self._ttft.above(self.ttft_slo_s, QUANTILE, now):
            return True, f"p99 time to first token {self._ttft.quantile(QUANTILE, now):.2f}s > {self.ttft_slo_s:g}s"
        if self._itl.count(now) >= self.min_itl_samples and self._itl.above(self.itl_slo_s, QUANTILE, now):
            return True, f"p99 inter-token latency {self._itl.quantile(QUANTILE, now):.3f}s > {self.itl_slo_s:g}s"
        if self._nonempty_since is not None and now - self._nonempty_since >= self.eval_window_s:
            return True, f"admission queue non-empty for {now - self._nonempty_since:.0f}s without draining"
        return False, "no overload signal"

    def _set_auto(self, degraded: bool, reason: str) -> None:
        before = self.degraded
        self._auto_degraded = degraded
        if self._forced is None:
            self._changed(before, reason)
        else:
            log.info("automatic degradation state is now %s (overridden: forced %s)", degraded, self._forced)

    def _changed(self, before: bool, reason: str) -> None:
        """Record and announce a change of the effective state (no-op if it did not change)."""
        after = self.degraded
        if after == before:
            return
        self._since = self._clock()
        self._reason = reason
        if self._on_change is not None:
            self._on_change(after, reason)


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
