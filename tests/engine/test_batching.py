"""Continuous batching must not change answers (float32)."""

from __future__ import annotations

import pytest

from helpers import final_tokens, greedy, run_all

PROMPTS = [
    "The quick brown fox",
    "Write a haiku about autumn leaves.",
    "What is 17 times 23?",
    "List the planets of the solar system in order from the sun.",
    "Translate 'good morning' into Spanish, French and German.",
    "Why is the sky blue? Answer in two sentences.",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
]


@pytest.mark.timeout(600)
def test_staggered_batch_matches_each_alone(fp32_engine):
    engine = fp32_engine
    engine.kv.pool.reset_prefix_cache()
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    alone = []
    for i, ids in enumerate(prompts):
        engine.add_request(f"alone-{i}", ids, greedy(24, ignore_eos=True))
        alone.append(final_tokens(run_all(engine)[f"alone-{i}"]))
    engine.kv.pool.reset_prefix_cache()

    # Submit one new prompt every 3 steps while the others decode.
    outputs: dict[str, list] = {}
    pending = list(enumerate(prompts))
    steps = 0
    while pending or engine.has_unfinished():
        if pending and steps % 3 == 0:
            i, ids = pending.pop(0)
            engine.add_request(f"batched-{i}", ids, greedy(24, ignore_eos=True))
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        steps += 1
    sequential_steps = len(prompts) * 24
    assert steps < sequential_steps / 2, "requests ran one after another; the test did not batch"
    for i in range(len(prompts)):
        assert final_tokens(outputs[f"batched-{i}"]) == alone[i], f"prompt {i} changed when batched"


@pytest.mark.timeout(120)
def test_a_dropped_engine_frees_its_memory_without_the_cyclic_collector(make_engine):
    """No part of an engine holds the engine (or a part that owns it) strongly: the last reference
    frees the KV pool and the weights at once. Tensor memory never triggers Python's cyclic
    collector, so a cycle kept ~1 GB per engine alive in a suite that builds many (CI was killed)."""
    import gc
    import weakref

    engine = make_engine(dtype="float32", quantization="int8", kv_cache_bytes=16 << 20)
    engine.add_request("r", engine.tokenizer.encode_chat([{"role": "user", "content": "Hi"}]), greedy(2))
    run_all(engine)
    pool, model = weakref.ref(engine.kv.kv), weakref.ref(engine.model)
    gc.disable()
    try:
        del engine
        assert pool() is None and model() is None
    finally:
        gc.enable()
