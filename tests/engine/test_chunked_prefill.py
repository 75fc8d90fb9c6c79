"""Chunked prefill: a long prompt never stalls running decodes beyond one chunk."""

from __future__ import annotations

import pytest

from helpers import final_tokens, greedy, run_all

LONG_PROMPT = [(i * 7919) % 40000 + 100 for i in range(2000)]


@pytest.mark.timeout(600)
def test_long_prompt_does_not_stall_decodes_and_matches_unchunked(make_engine):
    chunked = make_engine(dtype="float32", quantization="none", max_num_batched_tokens=256, enable_prefix_caching=False)
    decoders = [chunked.tokenizer.encode(f"Count slowly from {i} to one hundred:") for i in range(4)]
    for i, ids in enumerate(decoders):
        chunked.add_request(f"dec-{i}", ids, greedy(40, ignore_eos=True))
    for _ in range(3):  # the four are decoding
        chunked.step()
    chunked.add_request("long", LONG_PROMPT, greedy(8, ignore_eos=True))

    steps_while_prefilling = 0
    outputs: dict[str, list] = {}
    while chunked.has_unfinished():
        long_request = chunked.requests.get("long")
        prefilling = long_request is not None and long_request.num_output_tokens == 0
        decoding = {r for r in chunked.requests if r.startswith("dec-")}
        produced = set()
        for out in chunked.step():
            outputs.setdefault(out.request_id, []).append(out)
            produced.add(out.request_id)
        if prefilling:
            steps_while_prefilling += 1
            # Every decoder still running produced a token in this very step.
            assert decoding <= produced
    assert steps_while_prefilling >= 2000 // 256  # the prompt really was chunked

    whole = make_engine(dtype="float32", quantization="none", max_num_batched_tokens=4096, enable_prefix_caching=False)
    whole.add_request("long", LONG_PROMPT, greedy(8, ignore_eos=True))
    assert final_tokens(outputs["long"]) == final_tokens(run_all(whole)["long"])
