"""Abort and memory pressure: blocks always come back; preemption never deadlocks."""

from __future__ import annotations

import pytest

from helpers import final_tokens, greedy, run_all


@pytest.mark.timeout(300)
def test_abort_frees_every_block(fp32_engine):
    engine = fp32_engine
    idle_used = engine.kv.pool.num_used_blocks
    for i in range(6):
        engine.add_request(f"abort-{i}", list(range(100 + i, 400 + i)), greedy(50))
    for _ in range(3):
        engine.step()
    assert engine.kv.pool.num_used_blocks > idle_used
    for i in range(6):
        out = engine.abort(f"abort-{i}")
        assert out is not None and out.finished and out.finish_reason.value == "abort"
    assert engine.kv.pool.num_used_blocks == idle_used
    assert not engine.has_unfinished()
    assert engine.scheduler.num_running == 0 and engine.scheduler.num_waiting == 0


@pytest.mark.timeout(600)
def test_out_of_blocks_preempts_and_completes_everything(make_engine):
    # 40 usable blocks of 16 tokens; 6 requests that each grow to ~160 tokens (10 blocks).
    engine = make_engine(dtype="float32", quantization="none", max_num_batched_tokens=128)
    per_block = engine.kv.bytes_per_block
    small = make_engine(dtype="float32", quantization="none", max_num_batched_tokens=128, kv_cache_bytes=41 * per_block)
    assert small.kv.num_blocks == 41
    prompts = [list(range(500 + 37 * i, 600 + 37 * i)) for i in range(6)]
    for i, ids in enumerate(prompts):
        small.add_request(f"p-{i}", ids, greedy(60, ignore_eos=True))
    got = run_all(small)
    assert small.stats.preemptions > 0, "the pool was large enough; the test did not exercise preemption"
    assert small.kv.pool.num_used_blocks == 0
    # Preempted requests recompute and still give the same tokens as an unpressured run.
    for i, ids in enumerate(prompts):
        engine.add_request(f"ref-{i}", ids, greedy(60, ignore_eos=True))
    ref = run_all(engine)
    for i in range(6):
        assert len(final_tokens(got[f"p-{i}"])) == 60
        assert final_tokens(got[f"p-{i}"]) == final_tokens(ref[f"ref-{i}"])
