"""int8 weights: bounded per-layer error, and teacher-forced agreement with float32 (bounded near its measured value)."""

from __future__ import annotations

import pytest
import torch

from helpers import AGREEMENT_PROMPTS, prefill_forward, teacher_forced_agreement


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
def test_teacher_forced_agreement_with_float32(fp32_engine, int8_engine, make_engine, float32_agreement_sequences):
    """8 prompts x 64 float32-greedy tokens, fed to both: int8 picks float32's top token nearly everywhere.

    Measured 96.7 % (mean logit error 0.214) for the default W8A16 kernels and
    95.7 % (0.216) for the previous int8 path on 2026-12-03; a positional greedy
    comparison would instead count every token after the first divergence.
    """
    sequences = float32_agreement_sequences
    rate, error = teacher_forced_agreement(fp32_engine, int8_engine, sequences)
    previous_rate, previous_error = teacher_forced_agreement(fp32_engine, make_engine(quantization="int8", batch_invariant=False), sequences)
    print(
        f"\nteacher-forced top-1 agreement with float32 over {64 * len(sequences)} positions: "
        f"int8 W8A16 {rate:.2%} (mean |logit error| {error:.3f}), previous int8 path {previous_rate:.2%} ({previous_error:.3f})"
    )
    assert rate >= 0.95, "int8 disagrees with float32 more than measured: the quantization got worse"
    assert rate >= previous_rate - 0.005, "the default int8 kernels are less accurate than the previous path"
