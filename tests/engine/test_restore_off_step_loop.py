"""A warm restore from disk runs off the step loop: another stream keeps decoding meanwhile.

What is asserted is structural (the file is read on the storage thread while the engine
keeps stepping); how much the restore slows the other stream is a figure, printed here
and measured by ``python -m benchmarks tiers``: on two cores any CPU the storage thread takes
is taken from the compute threads, so a bound on it would be a timed unit test. The
figure, now vs the previous arrangement in one run: ``python -m benchmarks restore-stall``."""

from __future__ import annotations

import statistics
import threading
import time

import pytest

from ember.config import EngineConfig, SessionConfig
from ember.engine.engine import LLMEngine
import ember.engine.warm_storage as ws
from helpers import greedy
from test_sessions import FakeClock, tier_of


@pytest.mark.timeout(600)
def test_a_disk_restore_does_not_stall_another_decoding_stream(loaded_model, tmp_path, monkeypatch):
    clock = FakeClock()  # the session TTLs; the stream's gaps are timed with perf_counter
    sessions = SessionConfig(hot_ttl_s=1, warm_format="exact", session_dir=str(tmp_path), warm_memory_bytes=1, write_behind_s=-1)
    engine = LLMEngine(config=EngineConfig(), loaded=loaded_model, sessions=sessions, clock=clock)  # the default numerics
    tok = engine.tokenizer
    history = [{"role": "user", "content": "Remember these words: " + "river stone cloud " * 450 + "Now say OK."}]
    first = tok.encode_chat(history)
    assert len(first) > 1200  # a big conversation: its file is tens of MB (exact format), read and checked in ~0.1 s
    engine.add_request("c1", first, greedy(8, ignore_eos=True), session_id="c")
    while engine.has_unfinished():
        engine.step()
    clock.advance(2)
    engine.idle_tick()
    assert engine.sessions.settle() and tier_of(engine, "c") == "disk"
    engine.kv.pool.reset_prefix_cache()  # nothing of it left in the pool

    engine.add_request("s", tok.encode_chat([{"role": "user", "content": "Write a long story about the sea."}]), greedy(600, ignore_eos=True))
    stamps: list[float] = []

    def step() -> None:
        for out in engine.step():
            if out.request_id == "s" and out.new_token_ids:
                stamps.append(time.perf_counter())

    while len(stamps) < 40:
        step()
    baseline = statistics.median(b - a for a, b in zip(stamps[-30:], stamps[-29:]))

    readers: list[str] = []
    read_payload = ws.read_payload

    def spy(*args, **kwargs):  # the real read, noting which thread does it
        readers.append(threading.current_thread().name)
        return read_payload(*args, **kwargs)

    monkeypatch.setattr(ws, "read_payload", spy)
    turn2 = engine.sessions.data["c"].token_ids + tok.encode(" And now three more words?", add_bos=False)
    engine.add_request("c2", turn2, greedy(4, ignore_eos=True), session_id="c")
    assert "c2" in engine.loading  # its KV is being read off the step loop
    window: list[float] = [stamps[-1]]
    while True:  # the steps that end with c2 still waiting (the one that schedules it also prefills it)
        before = len(stamps)
        step()
        if "c2" not in engine.loading:
            break
        window += stamps[before:]
    gaps = [b - a for a, b in zip(window, window[1:])]
    print(
        f"\nrestore took {len(gaps)} decode steps of the other stream; gaps p50 {1000 * statistics.median(gaps):.1f} ms, "
        f"max {1000 * max(gaps):.1f} ms (not bounds: see the docstring), p50 before {1000 * baseline:.1f} ms"
    )
    assert len(gaps) >= 3, "the other stream did not keep decoding while the file was read"
    assert readers == ["ember-session-storage"]  # read once, by the storage thread

    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == "c2"]
    assert outs[-1].cache_tier == "disk" and outs[-1].num_cached_tokens > 1200
