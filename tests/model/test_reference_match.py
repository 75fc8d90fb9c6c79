"""Ember in float32 against transformers' LlamaForCausalLM loaded from the same GGUF."""

from __future__ import annotations

import pytest
import torch

from helpers import final_tokens, greedy, prefill_forward, run_all

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "List three colours."}],
    [{"role": "user", "content": "Écris une phrase en français sur la mer. 🌊"}],
    [{"role": "user", "content": "Explain what a hash table is, step by step."}],
]


@pytest.mark.timeout(600)
def test_last_position_logits_match_transformers(fp32_engine, hf_reference):
    model, _ = hf_reference
    for messages in PROMPTS:
        ids = fp32_engine.tokenizer.encode_chat(messages)
        ours = prefill_forward(fp32_engine, ids)
        with torch.no_grad():
            theirs = model(torch.tensor([ids])).logits[0, -1].float()
        assert int(ours.argmax()) == int(theirs.argmax())
        max_diff = float((ours - theirs).abs().max())
        assert max_diff < 2e-3, f"max |logit difference| {max_diff} for {messages!r}"


@pytest.mark.timeout(900)
def test_greedy_64_tokens_match_transformers(fp32_engine, hf_reference):
    model, _ = hf_reference
    for i, messages in enumerate(PROMPTS[:3]):
        ids = fp32_engine.tokenizer.encode_chat(messages)
        # min_tokens masks EOS like transformers' min_new_tokens, so both run 64 tokens.
        fp32_engine.add_request(f"ref-greedy-{i}", ids, greedy(64, min_tokens=64))
        ours = final_tokens(run_all(fp32_engine)[f"ref-greedy-{i}"])
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=64, min_new_tokens=64, do_sample=False)
        theirs = out[0, len(ids) :].tolist()
        assert ours == theirs, f"prompt {i}: first difference at {next(j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b)}"
