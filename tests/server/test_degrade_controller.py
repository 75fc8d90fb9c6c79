"""DegradationController: the rule, its hysteresis, forcing, and what degraded means.

A fake clock drives time; nothing sleeps. Unless a test says otherwise the
controller runs with the server defaults: objective 2 s, window 120 s, so the
evaluation window is 60 s and at least 20 samples are needed.
"""

from __future__ import annotations

import pytest

from ember.server.degrade import NO_CAP, DegradationController


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Recorder:
    """Collects on_change calls."""

    def __init__(self) -> None:
        self.changes: list[tuple[bool, str]] = []

    def __call__(self, degraded: bool, reason: str) -> None:
        self.changes.append((degraded, reason))

    @property
    def states(self) -> list[bool]:
        return [d for d, _ in self.changes]


def make(clock: FakeClock, recorder: Recorder | None = None, **kwargs) -> DegradationController:
    kwargs.setdefault("slo_p99_s", 2.0)
    kwargs.setdefault("window_s", 120.0)
    return DegradationController(clock=clock, on_change=recorder, **kwargs)


def run(ctrl: DegradationController, clock: FakeClock, seconds: float, e2e_s: float, ttft_s: float | None = 0.1, per_s: int = 2) -> None:
    """Finish ``per_s`` requests per second for ``seconds`` seconds, evaluating as the server would."""
    for _ in range(int(seconds)):
        for _ in range(per_s):
            ctrl.observe(e2e_s, ttft_s)
        clock.now += 1.0
        ctrl.evaluate()


def run_until_change(ctrl: DegradationController, clock: FakeClock, limit_s: int, e2e_s: float, ttft_s: float | None = 0.1) -> float:
    """Seconds of such traffic until ``ctrl.degraded`` flips (fails after ``limit_s``)."""
    started, before = clock.now, ctrl.degraded
    for _ in range(limit_s):
        run(ctrl, clock, 1, e2e_s, ttft_s)
        if ctrl.degraded != before:
            return clock.now - started
    raise AssertionError(f"no change within {limit_s}s")


# --------------------------------------------------------------------- entering


def test_enters_only_after_the_condition_held_for_the_whole_window() -> None:
    clock, rec = FakeClock(), Recorder()
    ctrl = make(clock, rec)
    # 2 slow requests a second: the 20th sample arrives 9 s in, when the
    # condition starts to hold; it must then hold for 120 s, until 129 s in.
    run(ctrl, clock, 128, e2e_s=3.0)
    assert not ctrl.degraded and rec.changes == []
    run(ctrl, clock, 1, e2e_s=3.0)
    assert ctrl.degraded
    assert rec.states == [True]
    assert "p99 end-to-end" in rec.changes[0][1] and "> 2s" in rec.changes[0][1]


def test_a_short_spike_does_not_enter() -> None:
    clock, rec = FakeClock(), Recorder()
    ctrl = make(clock, rec)
    run(ctrl, clock, 100, e2e_s=0.3)
    run(ctrl, clock, 30, e2e_s=5.0)  # p99 is over for 30 s + the 60 s evaluation window
    run(ctrl, clock, 300, e2e_s=0.3)
    assert not ctrl.degraded and rec.changes == []


def test_a_sustained_burst_enters() -> None:
    # Longer than window - eval window (60 s): p99 then stays over for the whole window.
    clock, rec = FakeClock(), Recorder()
    ctrl = make(clock, rec)
    run(ctrl, clock, 100, e2e_s=0.3)
    run(ctrl, clock, 90, e2e_s=5.0)
    run(ctrl, clock, 60, e2e_s=0.3)
    assert rec.states == [True]


def test_one_percent_slow_is_not_over_two_percent_is() -> None:
    clock = FakeClock()
    ctrl = make(clock, window_s=10.0, eval_window_s=5.0)
    for _ in range(99):
        ctrl.observe(1.0, 0.1)
    ctrl.observe(9.0, 0.1)
    assert ctrl.snapshot()["p99_e2e_s"] <= 2.0
    ctrl.observe(9.0, 0.1)
    ctrl.observe(9.0, 0.1)
    assert ctrl.snapshot()["p99_e2e_s"] > 2.0


def test_an_objective_between_buckets_is_decided_exactly() -> None:
    # 2.2 s is not a histogram bound; samples at 2.1 s must not count as over it.
    clock, rec = FakeClock(), Recorder()
    ctrl = make(clock, rec, slo_p99_s=2.2)
    run(ctrl, clock, 400, e2e_s=2.1)
    assert rec.changes == []
    run(ctrl, clock, 200, e2e_s=2.3)
    assert rec.states == [True]


def test_too_few_samples_never_trigger() -> None:
    clock, rec = FakeClock(), Recorder()
    ctrl = make(clock, rec, min_samples=20)
    for _ in range(1000):  # one very slow request every 5 s: 12 in any 60 s
        ctrl.observe(30.0, 10.0)
        clock.now += 5.0
        ctrl.evaluate()
    assert rec.changes == [] and not ctrl.degraded


# ---------------------------------------------------------------------- leaving


def test_leaves_only_after_a_full_window_below_the_objective() -> None:
    clock, rec = FakeClock(), Recorder()
    ctrl = make(clock, rec)
    run_until_change(ctrl, clock, 200, e2e_s=3.0)
    assert ctrl.degraded
    # Slow samples stay in the 60 s evaluation window after latency recovers,
    # then p99 must be under the objective for 120 s more.
    took = run_until_change(ctrl, clock, 400, e2e_s=0.2)
    assert 60 + 120 <= took <= 60 + 120 + 2
    assert rec.states == [True, False]
    assert "within the objective" in rec.changes[1][1]


def test_a_relapse_during_recovery_restarts_the_recovery_window() -> None:
    clock, rec = FakeClock(), Recorder()
    ctrl = make(clock, rec)
    run_until_change(ctrl, clock, 200, e2e_s=3.0)
    run(ctrl, clock, 150, e2e_s=0.2)  # under the objective for ~90 s of the 120 needed
    run(ctrl, clock, 5, e2e_s=9.0)
    run(ctrl, clock, 150, e2e_s=0.2)  # the relapse keeps p99 over for ~65 s of these
    assert ctrl.degraded and rec.states == [True]
    run(ctrl, clock, 40, e2e_s=0.2)
    assert rec.states == [True, False]


def test_leaves_when_traffic_stops() -> None:
    # No samples means nothing to protect; periodic evaluate() lets it recover.
    clock, rec = FakeClock(), Recorder()
    ctrl = make(clock, rec)
    run_until_change(ctrl, clock, 200, e2e_s=3.0)
    for _ in range(60 + 120 + 2):
        clock.now += 1.0
        ctrl.evaluate()
    assert rec.states == [True, False]
    assert ctrl.snapshot()["samples"] == 0


# ---------------------------------------------------------------------- forcing


def test_force_on_off_and_back_to_automatic() -> None:
    clock, rec = FakeClock(), Recorder()
    ctrl = make(clock, rec)
    ctrl.force(True)
    assert ctrl.degraded and ctrl.forced is True
    assert rec.changes == [(True, "forced on by an administrator")]
    ctrl.force(True)  # no change, no callback
    assert len(rec.changes) == 1
    ctrl.force(None)
    assert not ctrl.degraded and ctrl.forced is None
    assert rec.changes[-1] == (False, "automatic control resumed")

    # Forced off holds while the automatic rule wants to degrade...
    ctrl.force(False)
    assert len(rec.changes) == 2  # already off: nothing to announce
    run(ctrl, clock, 200, e2e_s=3.0)
    assert not ctrl.degraded and len(rec.changes) == 2
    assert ctrl.snapshot()["forced"] is False
    # ...and automatic control resumes from what the rule says now.
    ctrl.force(None)
    assert ctrl.degraded
    assert rec.changes[-1] == (True, "automatic control resumed")


def test_force_off_while_automatically_degraded() -> None:
    clock, rec = FakeClock(), Recorder()
    ctrl = make(clock, rec)
    run_until_change(ctrl, clock, 200, e2e_s=3.0)
    ctrl.force(False)
    assert not ctrl.degraded and ctrl.max_tokens_cap() == NO_CAP
    assert rec.states == [True, False]


# ------------------------------------------------------- what degraded changes


def test_clamp_shed_and_chunk_semantics() -> None:
    clock = FakeClock()
    ctrl = make(clock, clamp_max_tokens=80, degraded_chunk_tokens=128)
    assert ctrl.max_tokens_cap() == NO_CAP
    assert min(1024, ctrl.max_tokens_cap()) == 1024  # how the server combines limits
    assert [ctrl.should_shed(p) for p in (0, 1, 2)] == [False, False, False]
    assert ctrl.prefill_chunk_tokens(512) == 512

    ctrl.force(True)
    assert ctrl.max_tokens_cap() == 80
    assert [ctrl.should_shed(p) for p in (0, 1, 2)] == [False, False, True]
    assert ctrl.prefill_chunk_tokens(512) == 128
    assert ctrl.prefill_chunk_tokens(64) == 64  # never raises a smaller budget


# ------------------------------------------------------------------------- TTFT


def test_ttft_objective_triggers_on_its_own() -> None:
    clock, rec = FakeClock(), Recorder()
    ctrl = make(clock, rec, ttft_slo_s=1.0)
    took = run_until_change(ctrl, clock, 200, e2e_s=1.8, ttft_s=1.5)  # e2e is within its objective
    assert 120 <= took <= 132
    assert "time to first token" in rec.changes[0][1]


def test_without_a_ttft_objective_slow_ttft_alone_does_nothing() -> None:
    clock, rec = FakeClock(), Recorder()
    ctrl = make(clock, rec)
    run(ctrl, clock, 300, e2e_s=1.8, ttft_s=1.5)
    assert rec.changes == []
    assert ctrl.snapshot()["p99_ttft_s"] > 1.0


def test_requests_without_a_first_token_only_count_for_e2e() -> None:
    clock = FakeClock()
    ctrl = make(clock, ttft_slo_s=1.0)
    run(ctrl, clock, 10, e2e_s=0.5, ttft_s=None)
    snap = ctrl.snapshot()
    assert snap["samples"] == 20 and snap["p99_ttft_s"] is None


# ----------------------------------------------------------- memory and health


def test_memory_stays_bounded() -> None:
    clock = FakeClock()
    ctrl = make(clock, window_s=20.0, eval_window_s=10.0, slot_s=1.0)
    for _ in range(2000):
        for _ in range(50):
            ctrl.observe(0.1, 0.05)
        clock.now += 0.5
    assert ctrl.retained_slots <= 10 / 1.0 + 1
    # Only the evaluation window's samples (plus the current partial slot) are counted.
    assert ctrl.snapshot()["samples"] <= 50 * 2 * 11


def test_snapshot_for_health() -> None:
    clock, rec = FakeClock(), Recorder()
    ctrl = make(clock, rec, ttft_slo_s=1.0)
    snap = ctrl.snapshot()
    assert snap["degraded"] is False and snap["forced"] is None
    assert snap["p99_e2e_s"] is None and snap["since"] is None and snap["reason"] == ""
    run(ctrl, clock, 10, e2e_s=0.09, ttft_s=0.04)
    snap = ctrl.snapshot()
    assert 0.075 < snap["p99_e2e_s"] <= 0.1  # interpolated inside the (0.075, 0.1] bucket
    assert 0.025 < snap["p99_ttft_s"] <= 0.05
    ctrl.force(True)
    clock.now += 7
    snap = ctrl.snapshot()
    assert snap["degraded"] is True and snap["forced"] is True
    assert snap["since"] == clock.now - 7 and snap["seconds_in_state"] == 7
    assert snap["reason"] == "forced on by an administrator"
    assert snap["slo_p99_s"] == 2.0 and snap["window_s"] == 120.0 and snap["eval_window_s"] == 60.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"eval_window_s": 120.0},  # must be shorter than the window
        {"slo_p99_s": 0.0},
        {"window_s": -1.0},
        {"ttft_slo_s": 0.0},
        {"min_samples": 0},
        {"slot_s": 100.0},
    ],
)
def test_rejects_unusable_settings(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        make(FakeClock(), **kwargs)
