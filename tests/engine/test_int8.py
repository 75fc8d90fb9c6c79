"""int8 weights: bounded per-layer error, and greedy agreement with bfloat16 (reported)."""

from __future__ import annotations

import pytest
import torch

from helpers import final_tokens, greedy, prefill_forward, run_all

AGREEMENT_PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain photosynthesis to a child.",
    "Give me three tips for learning Python.",
    "What is 12 plus 30?",
    "Describe a cat in one sentence.",
    "Who wrote Romeo and Juliet?",
    "Name the largest ocean on Earth.",
]


@pytest.fixture(scope="module")
def int8_engine(make_engine):
    return make_engine(dtype="float32", quantization="int8")


@pytest.fixture(scope="module")
def bf16_engine(make_engine):
    return make_engine(dtype="bfloat16", quantization="none")


def test_int8_weights_round_trip_within_half_a_step():
    from ember.model.quant import quantize_per_channel_int8

    w = torch.randn(64, 128)
    q, scale = quantize_per_channel_int8(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
    err = (q.float() * scale[:, None] - w).abs()
    assert bool((err <= scale[:, None] / 2 + 1e-7).all())


@pytest.mark.timeout(300)
def test_per_layer_error_is_bounded(fp32_engine, int8_engine):
    ids = fp32_engine.tokenizer.encode_chat([{"role": "user", "content": AGREEMENT_PROMPTS[2]}])
    exact = prefill_forward(fp32_engine, ids, per_layer=True)
    quant = prefill_forward(int8_engine, ids, per_layer=True)
    worst = 0.0
    for i, (a, b) in enumerate(zip(quant, exact)):
        relative = float((a - b).norm() / b.norm())
        worst = max(worst, relative)
        assert relative < 0.08, f"layer {i}: relative error {relative:.4f}"
    print(f"\nint8 worst per-layer relative error: {worst:.4f}")


@pytest.mark.timeout(600)
def test_greedy_agreement_with_bf16_is_reported(int8_engine, bf16_engine):
    agree = total = 0
    for engine, tag in ((int8_engine, "int8"), (bf16_engine, "bf16")):
        for i, p in enumerate(AGREEMENT_PROMPTS):
            engine.add_request(f"{tag}-{i}", engine.tokenizer.encode_chat([{"role": "user", "content": p}]), greedy(16, min_tokens=16))
    int8_out = run_all(int8_engine)
    bf16_out = run_all(bf16_engine)
    prefix_lengths = []
    for i in range(len(AGREEMENT_PROMPTS)):
        a, b = final_tokens(int8_out[f"int8-{i}"]), final_tokens(bf16_out[f"bf16-{i}"])
        agree += sum(x == y for x, y in zip(a, b))
        total += len(b)
        prefix_lengths.append(next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), len(b)))
    rate = agree / total
    print(f"\nint8 vs bf16 greedy agreement over 16 tokens: {rate:.1%} of positions; common prefix per prompt: {prefix_lengths}")
    assert rate >= 0.5, "int8 output diverged from bf16 on most positions: quantization is broken"
