"""Degradation controller: protect latency when p99 stays above the objective.

The controller watches the server's own end-to-end latency (and, optionally,
time to first token). When their p99 stays above the objective for a whole
window it enters *degraded* mode: max_tokens is clamped to the ``support``
preset, low-priority requests are shed and prefill chunks shrink so running
streams keep a steady inter-token latency. It leaves with hysteresis: only
after p99 has been back under the objective for another whole window.

The rule mirrors the shipped Prometheus alert
``histogram_quantile(0.99, rate(llm_request_duration_seconds_bucket[1m])) > 2 for 2m``:

- *the condition*: p99 over a trailing **evaluation window** (``eval_window_s``,
  default half of ``window_s``, so 60 s for the default 120 s) is above the
  objective, with at least ``min_samples`` samples in that window;
- *enter*: the condition has held at every evaluation for ``window_s``;
- *leave*: the condition has been false at every evaluation for ``window_s``.

Because the evaluation window is shorter than ``window_s``, one slow burst
shorter than ``window_s - eval_window_s`` can never trigger: it leaves the
trailing window before the condition has held long enough.

Latencies are counted in per-second slots of histogram buckets (the same
bounds as the exported histograms, plus the objectives themselves so "p99 is
above the objective" is decided exactly rather than interpolated). Memory is
therefore fixed: at most ``eval_window_s / slot_s + 1`` slots of
``len(bounds) + 1`` counters, whatever the request rate. Running totals make
``observe`` and ``evaluate`` O(number of bounds), cheap enough for every request.

Everything runs on one thread (the server's event loop); the controller takes
no locks. The clock is injectable so tests drive time without sleeping.
"""

from __future__ import annotations

import bisect
import logging
import math
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from ember.config import MAX_TOKENS_PRESETS
from ember.server.metrics import LATENCY_BUCKETS

log = logging.getLogger("ember.server.degrade")

QUANTILE = 0.99
# The ``support`` preset (80): short answers keep every stream, and so the queue, short.
DEFAULT_CLAMP_MAX_TOKENS = MAX_TOKENS_PRESETS["support"]
# A quarter of the default step budget: a long prompt then delays running streams far less.
DEFAULT_DEGRADED_CHUNK_TOKENS = 128
# Below this many samples in the evaluation window a p99 is noise: one slow
# request among a handful must not degrade the whole server.
DEFAULT_MIN_SAMPLES = 20
# Priority values as in engine.request.Priority (0 high, 1 normal, 2 low); kept
# as a plain int so this module stays free of engine imports.
LOW_PRIORITY = 2
# "No cap" for max_tokens_cap(): larger than any real limit, so min() keeps the other one.
NO_CAP = sys.maxsize


@dataclass
class _Slot:
    """Counts of the latencies observed during one slot of ``slot_s`` seconds.

    ``e2e[i]`` / ``ttft[i]`` count samples with ``bounds[i-1] < value <= bounds[i]``;
    the last entry is the +Inf bucket.
    """

    start: float
    e2e: list[int]
    ttft: list[int]


@dataclass
class _Window:
    """Running totals over the slots still inside the evaluation window.

    Invariant: ``e2e`` / ``ttft`` are the element-wise sums of the retained
    slots' counts, and ``e2e_n`` / ``ttft_n`` their totals.
    """

    e2e: list[int]
    ttft: list[int]
    e2e_n: int = 0
    ttft_n: int = 0


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
        slo_p99_s: float,
        window_s: float,
        ttft_slo_s: float | None = None,
        clamp_max_tokens: int = DEFAULT_CLAMP_MAX_TOKENS,
        degraded_chunk_tokens: int = DEFAULT_DEGRADED_CHUNK_TOKENS,
        min_samples: int = DEFAULT_MIN_SAMPLES,
        eval_window_s: float | None = None,
        slot_s: float = 1.0,
        bounds: Iterable[float] = LATENCY_BUCKETS,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[bool, str], None] | None = None,
    ) -> None:
        """Set up an automatic (not forced), non-degraded controller.

        ``eval_window_s`` defaults to ``window_s / 2`` and must be shorter than
        ``window_s`` (otherwise a single spike could hold p99 up for a whole window).
        ``bounds`` are histogram upper bounds for estimating p99; the objectives
        are added to them.
        """
        if slo_p99_s <= 0 or window_s <= 0:
            raise ValueError("slo_p99_s and window_s must be positive")
        if ttft_slo_s is not None and ttft_slo_s <= 0:
            raise ValueError("ttft_slo_s must be positive")
        eval_window_s = window_s / 2 if eval_window_s is None else eval_window_s
        if not 0 < eval_window_s < window_s:
            raise ValueError("eval_window_s must be positive and shorter than window_s")
        if slot_s <= 0 or slot_s > eval_window_s:
            raise ValueError("slot_s must be positive and at most eval_window_s")
        if clamp_max_tokens < 1 or degraded_chunk_tokens < 1 or min_samples < 1:
            raise ValueError("clamp_max_tokens, degraded_chunk_tokens and min_samples must be >= 1")
        self.slo_p99_s = slo_p99_s
        self.window_s = window_s
        self.ttft_slo_s = ttft_slo_s
        self.clamp_max_tokens = clamp_max_tokens
        self.degraded_chunk_tokens = degraded_chunk_tokens
        self.min_samples = min_samples
        self.eval_window_s = eval_window_s
        self.slot_s = slot_s
        objectives = [slo_p99_s] + ([ttft_slo_s] if ttft_slo_s is not None else [])
        self._bounds: list[float] = sorted(set(bounds) | set(objectives))
        self._slo_index = self._bounds.index(slo_p99_s)
        self._ttft_slo_index = None if ttft_slo_s is None else self._bounds.index(ttft_slo_s)
        self._clock = clock
        self._on_change = on_change
        self._slots: deque[_Slot] = deque()
        self._window = _Window(e2e=self._zeros(), ttft=self._zeros())
        self._timers = _Timers()
        self._auto_degraded = False
        self._forced: bool | None = None
        self._since: float | None = None
        self._reason = ""

    # ------------------------------------------------------------------ inputs

    def observe(self, e2e_s: float, ttft_s: float | None = None) -> None:
        """Record one finished request's latencies, then re-evaluate.

        ``ttft_s`` is None for a request that produced no token.
        """
        now = self._clock()
        slot = self._slot_at(now)
        i = bisect.bisect_left(self._bounds, e2e_s)  # first bound >= value: the "le" bucket
        slot.e2e[i] += 1
        self._window.e2e[i] += 1
        self._window.e2e_n += 1
        if ttft_s is not None:
            j = bisect.bisect_left(self._bounds, ttft_s)
            slot.ttft[j] += 1
            self._window.ttft[j] += 1
            self._window.ttft_n += 1
        self._evaluate_at(now)

    def evaluate(self) -> None:
        """Re-check the rule at the current time.

        The server calls this periodically (say every second) so the controller
        also moves when no request finishes, e.g. leaves once traffic stops.
        """
        self._evaluate_at(self._clock())

    def force(self, state: bool | None) -> None:
        """Force degraded mode on (True) or off (False); None returns to automatic.

        The automatic rule keeps tracking latency while forced, so returning to
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
        """Time slots held in memory; bounded by ``eval_window_s / slot_s + 1``."""
        return len(self._slots)

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
        """State for ``/health``.

        ``since`` is the controller clock's reading at the last change (None if
        it never changed) and ``seconds_in_state`` how long ago that was.
        p99 values are estimated from the buckets like ``histogram_quantile``,
        over the evaluation window; None with no samples.
        """
        now = self._clock()
        self._expire(now)
        w = self._window
        return {
            "degraded": self.degraded,
            "forced": self._forced,
            "p99_e2e_s": _rounded(self._quantile(w.e2e, w.e2e_n)),
            "p99_ttft_s": _rounded(self._quantile(w.ttft, w.ttft_n)),
            "samples": w.e2e_n,
            "slo_p99_s": self.slo_p99_s,
            "ttft_slo_s": self.ttft_slo_s,
            "window_s": self.window_s,
            "eval_window_s": self.eval_window_s,
            "since": self._since,
            "seconds_in_state": None if self._since is None else round(now - self._since, 3),
            "reason": self._reason,
        }

    # ---------------------------------------------------------------- the rule

    def _evaluate_at(self, now: float) -> None:
        """Apply the rule at ``now``: a state flips only after the opposite
        condition has held at every evaluation for ``window_s`` (hysteresis)."""
        self._expire(now)
        over, detail = self._condition()
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

    def _condition(self) -> tuple[bool, str]:
        """Whether p99 over the evaluation window is above an objective, and why.

        Too few samples count as "not above": a quiet server cannot trigger,
        and a server whose traffic stopped recovers instead of staying
        degraded forever.
        """
        w = self._window
        if w.e2e_n >= self.min_samples and _above(w.e2e, w.e2e_n, self._slo_index):
            p99 = self._quantile(w.e2e, w.e2e_n)
            return True, f"p99 end-to-end {p99:.2f}s > {self.slo_p99_s:g}s"
        if (
            self._ttft_slo_index is not None
            and w.ttft_n >= self.min_samples
            and _above(w.ttft, w.ttft_n, self._ttft_slo_index)
        ):
            p99 = self._quantile(w.ttft, w.ttft_n)
            return True, f"p99 time to first token {p99:.2f}s > {self._bounds[self._ttft_slo_index]:g}s"
        if w.e2e_n < self.min_samples:
            return False, f"fewer than {self.min_samples} samples in {self.eval_window_s:g}s"
        return False, "p99 within the objective"

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

    # ------------------------------------------------------------- the buckets

    def _zeros(self) -> list[int]:
        return [0] * (len(self._bounds) + 1)  # +1: the +Inf bucket

    def _slot_at(self, now: float) -> _Slot:
        """The slot covering ``now``, created if needed (old slots are expired first)."""
        self._expire(now)
        start = math.floor(now / self.slot_s) * self.slot_s
        if not self._slots or self._slots[-1].start != start:
            self._slots.append(_Slot(start, self._zeros(), self._zeros()))
        return self._slots[-1]

    def _expire(self, now: float) -> None:
        """Drop slots that ended before the evaluation window, keeping the totals in step."""
        horizon = now - self.eval_window_s
        w = self._window
        while self._slots and self._slots[0].start + self.slot_s <= horizon:
            old = self._slots.popleft()
            for i, c in enumerate(old.e2e):
                w.e2e[i] -= c
            for i, c in enumerate(old.ttft):
                w.ttft[i] -= c
            w.e2e_n -= sum(old.e2e)
            w.ttft_n -= sum(old.ttft)

    def _quantile(self, counts: list[int], n: int) -> float | None:
        """Estimate the p99 the way Prometheus' ``histogram_quantile`` does.

        Linear interpolation inside the bucket holding the rank; a rank in the
        +Inf bucket reports the highest finite bound.
        """
        if n == 0:
            return None
        rank = QUANTILE * n
        cumulative = 0
        for i, count in enumerate(counts):
            below = cumulative
            cumulative += count
            if cumulative >= rank and count > 0:
                if i == len(self._bounds):
                    return self._bounds[-1]
                lower = self._bounds[i - 1] if i > 0 else 0.0
                return lower + (self._bounds[i] - lower) * (rank - below) / count
        return self._bounds[-1]


def _above(counts: list[int], n: int, objective_index: int) -> bool:
    """p99 > objective, decided exactly: fewer than 99 % of the samples are <= the objective.

    Exact (no interpolation) because the objective is itself a bucket bound,
    at ``objective_index``; this is also what the interpolated p99 would say.
    """
    at_or_below = sum(counts[: objective_index + 1])
    return at_or_below < QUANTILE * n


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
