"""``python -m benchmarks restore-stall``: does a warm restore from disk slow another decoding stream?

A conversation of ~1,300 tokens goes to the disk tier (``--warm-format exact``:
a ~55 MB file). While another stream decodes, its next turn arrives; its KV is
read, checked and copied into the pool by the storage thread. The figure is
the other stream's inter-token gaps while that restore is in flight, against
its own gaps just before (same engine, same run):

* **now**: the storage thread runs in idle CPU time (``SCHED_IDLE``) with
  256 KB I/O chunks (``engine/session_storage.py``, ``engine/warm_storage.py``);
* **previous**: normal priority, paced to half duty while the engine is busy,
  4 MB chunks (what the code did before).

Each arrangement runs ``--runs`` times, alternating, each with a fresh engine
on the one loaded model. Reported per arrangement: the median over runs of
(gap p50 during / gap p50 before), the worst run's ratio, the largest gap
against the largest gap before the restore, and the restore's duration.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

MB = 1 << 20


class _Clock:
    """The session TTLs' clock, moved by hand (the stream's gaps are timed with perf_counter)."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@dataclass
class StallRun:
    before_p50_s: float
    before_max_s: float
    during_p50_s: float
    during_max_s: float
    gaps: int
    restore_s: float


def one_run(loaded: Any, threads: int) -> StallRun:
    from ember.config import EngineConfig, SessionConfig
    from ember.engine.engine import LLMEngine
    from ember.engine.sampling import SamplingParams

    clock = _Clock()
    with tempfile.TemporaryDirectory() as directory:
        sessions = SessionConfig(hot_ttl_s=1, warm_format="exact", session_dir=directory, warm_memory_bytes=1, write_behind_s=-1)
        engine = LLMEngine(config=EngineConfig(threads=threads), loaded=loaded, sessions=sessions, clock=clock)
        try:
            return _measure(engine, clock, SamplingParams)
        finally:
            engine.sessions.close()


def _measure(engine: Any, clock: _Clock, sampling: Any) -> StallRun:
    tok = engine.tokenizer
    history = [{"role": "user", "content": "Remember these words: " + "river stone cloud " * 450 + "Now say OK."}]
    engine.add_request("c1", tok.encode_chat(history), sampling(max_tokens=8, temperature=0.0, ignore_eos=True), session_id="c")
    while engine.has_unfinished():
        engine.step()
    clock.t += 2
    engine.idle_tick()
    if not engine.sessions.settle() or engine.sessions.info("c")["location"] != "disk":
        raise RuntimeError("the conversation did not reach the disk tier")
    engine.kv.pool.reset_prefix_cache()
    story = tok.encode_chat([{"role": "user", "content": "Write a long story about the sea."}])
    engine.add_request("s", story, sampling(max_tokens=2000, temperature=0.0, ignore_eos=True))
    stamps: list[float] = []

    def step() -> None:
        # One stamp per step that gave the stream tokens (a step that verified a draft gives several at once).
        if any(out.request_id == "s" and out.new_token_ids for out in engine.step()):
            stamps.append(time.perf_counter())

    while len(stamps) < 160:
        step()
    before = [b - a for a, b in itertools.pairwise(stamps[40:])]
    turn2 = engine.sessions.data["c"].token_ids + tok.encode(" And now three more words?", add_bos=False)
    started = time.perf_counter()
    engine.add_request("c2", turn2, sampling(max_tokens=4, temperature=0.0, ignore_eos=True), session_id="c")
    window = [stamps[-1]]
    while "c2" in engine.loading:
        seen = len(stamps)
        step()
        if "c2" in engine.loading:  # the step that schedules c2 also prefills it: not part of the restore
            window += stamps[seen:]
    restore_s = time.perf_counter() - started
    during = [b - a for a, b in itertools.pairwise(window)] or [float("nan")]
    return StallRun(statistics.median(before), max(before), statistics.median(during), max(during), len(during), restore_s)


@contextlib.contextmanager
def previous_arrangement() -> Iterator[None]:
    """The storage thread as it was before (normal priority, paced, 4 MB chunks) inside the block."""
    from ember.engine import compute_threads
    from ember.engine import warm_storage as ws

    idle, chunk = compute_threads.run_in_idle_time, ws.CHUNK_BYTES
    compute_threads.run_in_idle_time = lambda idle: False  # type: ignore[assignment]
    ws.CHUNK_BYTES = 4 * MB
    try:
        yield
    finally:
        compute_threads.run_in_idle_time, ws.CHUNK_BYTES = idle, chunk  # type: ignore[assignment]


def report(results: dict[str, list[StallRun]]) -> str:
    lines = [
        "| storage thread | gap p50 during / before (median of runs) | each run | largest gap during / before | restore (median) |",
        "|---|---|---|---|---|",
    ]
    for name, runs in results.items():
        ratios = [r.during_p50_s / r.before_p50_s for r in runs]
        during_max = max(r.during_max_s for r in runs) * 1000
        before_max = max(r.before_max_s for r in runs) * 1000
        lines.append(
            f"| {name} | {statistics.median(ratios):.2f}x | {', '.join(f'{x:.2f}' for x in ratios)} | {during_max:.1f} / {before_max:.1f} ms | "
            f"{statistics.median(r.restore_s for r in runs) * 1000:.0f} ms |"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=2, help="engine threads (default %(default)s)")
    parser.add_argument("--runs", type=int, default=5, help="runs per arrangement, alternating (default %(default)s)")


def main(args: argparse.Namespace) -> int:
    from ember.model.loader import load_model

    loaded = load_model(None)
    arrangements: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
        "now (idle CPU time, 256 KB chunks)": contextlib.nullcontext,
        "previous (paced, 4 MB chunks)": previous_arrangement,
    }
    results: dict[str, list[StallRun]] = {name: [] for name in arrangements}
    for _ in range(args.runs):
        for name, arrangement in arrangements.items():
            with arrangement():
                results[name].append(one_run(loaded, args.threads))
    print(report(results))
    return 0
