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


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["int8_engine", "fp32_engine"])
def test_requests_admitted_in_one_step_compute_their_shared_prefix_once(mode, request):
    """Six prompts with one 40-token "system prompt" arrive together: the first computes its
    two full blocks, the other five find them in the same step (in-step prefix sharing),
    and each answers token for token as it does alone with nothing cached."""
    engine = request.getfixturevalue(mode)
    engine.kv.pool.reset_prefix_cache()
    bs = engine.kv.block_size
    system = list(range(1000, 1040))
    prompts = {f"burst-{i}": system + [2000 + i, 2100 + i, 2200 + i] for i in range(6)}
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, greedy(8, ignore_eos=True))
    before = engine.stats.prefill_tokens_computed
    first = engine.step()  # every prompt fits this step's token budget
    shared = (len(system) // bs) * bs
    assert engine.stats.prefill_tokens_computed - before == sum(len(p) for p in prompts.values()) - 5 * shared
    together = {out.request_id: [out] for out in first}
    for request_id, outputs in run_all(engine).items():
        together[request_id] += outputs
    assert [together[r][-1].num_cached_tokens for r in prompts] == [0] + [shared] * 5

    for request_id, prompt in prompts.items():
        engine.kv.pool.reset_prefix_cache()
        engine.add_request(f"{request_id}-alone", prompt, greedy(8, ignore_eos=True))
        alone = run_all(engine)[f"{request_id}-alone"]
        assert alone[-1].num_cached_tokens == 0
        assert final_tokens(alone) == final_tokens(together[request_id]), request_id


@pytest.mark.timeout(300)
def test_a_failed_step_takes_back_the_blocks_it_published(fp32_engine, monkeypatch):
    """Blocks are published when scheduled; if the forward pass then fails, their KV was
    never written, and no later request may find them."""
    engine = fp32_engine
    engine.kv.pool.reset_prefix_cache()
    prompt = SHARED_PREFIX[:40] + [7, 8, 9]
    engine.add_request("fails", prompt, greedy(4))

    def fail(sched):
        raise RuntimeError("injected forward failure")

    monkeypatch.setattr(engine.runner, "execute", fail)
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="abort the requests that were in flight before stepping again: fails"):
        engine.step()  # its KV may be half written: it must not run on
    engine.abort("fails")
    engine.add_request("after", prompt, greedy(4))
    assert engine.kv.find_cached_prefix(engine.requests["after"]) == []
    out = run_all(engine)["after"]
    assert out[-1].num_cached_tokens == 0
