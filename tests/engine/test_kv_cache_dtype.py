"""The opt-in float16 KV cache (``EngineConfig.kv_cache_dtype``): twice the tokens, answers within a measured agreement.

The kernels read float16 keys and values as float32 and do float32's arithmetic
(tests/model/test_kernels.py proves the bits), so the only change is the rounding
of what is stored. That rounding can change a token, which is why the cache is
opt-in: this file prints how often it does.
"""

from __future__ import annotations

import pytest
import torch
from helpers import AGREEMENT_PROMPTS, final_tokens, greedy, run_all, teacher_forced_agreement

from ember.engine.kv_cache import bytes_per_block
from ember.errors import InvalidSamplingParamsError

pytestmark = pytest.mark.timeout(600)
BUDGET = 64 * 1024 * 1024


@pytest.fixture(scope="module")
def float32_cache(make_engine):
    return make_engine(kv_cache_bytes=BUDGET)


@pytest.fixture(scope="module")
def float16_cache(make_engine):
    return make_engine(kv_cache_bytes=BUDGET, kv_cache_dtype="float16")


def test_a_float16_cache_holds_twice_the_tokens_in_the_same_budget(float32_cache, float16_cache):
    assert float32_cache.kv.kv.dtype == torch.float32 and float16_cache.kv.kv.dtype == torch.float16
    config, block = float16_cache.model_config, float16_cache.kv.block_size
    assert float16_cache.kv.bytes_per_block * 2 == float32_cache.kv.bytes_per_block == bytes_per_block(config, block, torch.float32)
    assert float16_cache.kv.num_blocks == BUDGET // bytes_per_block(config, block, torch.float16)
    assert float16_cache.kv.capacity_tokens >= 2 * float32_cache.kv.capacity_tokens


def test_an_unknown_cache_dtype_is_refused_by_name(make_engine):
    with pytest.raises(InvalidSamplingParamsError, match="kv_cache_dtype"):
        make_engine(kv_cache_dtype="int4")


def test_restored_blocks_saturate_in_a_float16_cache(float16_cache):
    """A warm block written back into a float16 pool follows the kernels' rule
    (model/kv_values.py): out-of-range values become ±65,504, never infinity."""
    kv = float16_cache.kv
    layers, two, _, heads, dim = kv.kv.shape
    block = kv.pool.allocate(1)[0]
    try:
        data = torch.randn(layers, two, 1, kv.block_size, heads, dim)
        data[0, 0, 0, 0, 0, :3] = torch.tensor([1e6, -7e4, 65500.0])
        kv.write_blocks([block.block_id], data)
        stored = kv.read_blocks([block.block_id])
        assert torch.isfinite(stored).all()
        assert stored[0, 0, 0, 0, 0, :3].tolist() == [65504.0, -65504.0, 65504.0]  # 65,500 rounds to 65,504 as it would anyway
        assert torch.equal(stored[1:], data[1:].half())  # in range: a plain conversion's bits
    finally:
        kv.pool.release([block])


def _greedy_runs(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    for i, ids in enumerate(prompts):
        engine.add_request(f"p{i}", ids, greedy(max_tokens, ignore_eos=True))
    outputs = run_all(engine)
    return [final_tokens(outputs[f"p{i}"]) for i in range(len(prompts))]


def test_float16_cache_agreement_with_the_float32_cache(float32_cache, float16_cache, fp32_engine, float32_agreement_sequences):
    """8 prompts x 64 greedy tokens (int8 weights, the default), the float16 cache against the float32 one.

    Teacher-forced: both fed the float32 cache's tokens, how often they pick the
    same top token; free-running: how many of the 8 answers are the same token
    for token. And against the float32 reference model, next to the default
    int8 mode's own agreement, so the float16 cache's share of the error shows.
    """
    prompts = [float32_cache.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in AGREEMENT_PROMPTS]
    default_answers = _greedy_runs(float32_cache, prompts, 64)
    float16_answers = _greedy_runs(float16_cache, prompts, 64)
    identical = sum(a == b for a, b in zip(default_answers, float16_answers, strict=True))
    rate, error = teacher_forced_agreement(float32_cache, float16_cache, list(zip(prompts, default_answers, strict=True)))
    reference = float32_agreement_sequences
    assert [ids for ids, _ in reference] == prompts
    default_vs_reference, _ = teacher_forced_agreement(fp32_engine, float32_cache, reference)
    float16_vs_reference, _ = teacher_forced_agreement(fp32_engine, float16_cache, reference)
    print(
        f"\nfloat16 KV cache vs float32 KV cache (int8 weights), {64 * len(prompts)} positions: teacher-forced top-1 "
        f"agreement {rate:.2%} (mean |logit error| {error:.4f}); identical greedy answers {identical} of {len(prompts)}\n"
        f"against the float32 reference model: float32 cache {default_vs_reference:.2%}, float16 cache {float16_vs_reference:.2%}"
    )
    assert rate >= 0.99, "the float16 cache disagrees with float32's more than measured"
    assert float16_vs_reference >= default_vs_reference - 0.01, "the float16 cache costs more accuracy than measured"
