"""Prefix reuse: a shared prefix is computed once, and reusing it changes nothing."""

from __future__ import annotations

import pytest

from helpers import final_tokens, greedy, run_all

SHARED_PREFIX = list(range(1000, 1500))  # 500 tokens of a "system prompt"


@pytest.mark.timeout(300)
def test_second_request_computes_only_its_new_tokens(fp32_engine):
    engine = fp32_engine
    engine.kv.pool.reset_prefix_cache()
    first = SHARED_PREFIX + [40, 41, 42]
    second = SHARED_PREFIX + [50, 51, 52, 53, 54]

    engine.add_request("prefix-first", first, greedy(8))
    run_all(engine)
    before = engine.stats.prefill_tokens_computed
    engine.add_request("prefix-second", second, greedy(8, ignore_eos=True))
    warm = run_all(engine)["prefix-second"]
    computed = engine.stats.prefill_tokens_computed - before

    cached = warm[-1].num_cached_tokens
    assert cached == (500 // engine.kv.block_size) * engine.kv.block_size  # full blocks of the prefix
    assert computed == len(second) - cached  # only the new tokens (and the prefix's partial block)

    engine.kv.pool.reset_prefix_cache()
    engine.add_request("prefix-cold", second, greedy(8, ignore_eos=True))
    cold = run_all(engine)["prefix-cold"]
    assert cold[-1].num_cached_tokens == 0
    assert final_tokens(warm) == final_tokens(cold)


@pytest.mark.timeout(300)
def test_conversation_turn_reuses_generated_tokens(fp32_engine):
    engine = fp32_engine
    engine.kv.pool.reset_prefix_cache()
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "Name a fruit."}]) + list(range(2000, 2100))
    engine.add_request("turn-1", prompt, greedy(40, ignore_eos=True))
    out = run_all(engine)["turn-1"]
    history = prompt + final_tokens(out)
    engine.add_request("turn-2", history + [3000, 3001], greedy(4))
    second = run_all(engine)["turn-2"]
    # Every full block of the previous turn (prompt and generated tokens) is reused,
    # except the last generated token, whose KV was never computed.
    bs = engine.kv.block_size
    assert second[-1].num_cached_tokens == ((len(history) - 1) // bs) * bs
