"""Same request, same tokens: whatever shares the batch, however the prompt was cached or chunked.

The matrix of issue "Same seed, same answer", at the engine: 8 prompts, greedy
and seeded sampling (temperature 0.8, top_p 0.95), each compared token id for
token id with the same request run alone on a fresh engine, in the default int8
mode and in float32. Variations: batches of 5, 16 and 40 sequences at staggered
offsets, a prefix-cache hit (``num_cached_tokens`` asserted) among other
streams, and prompt chunks of 7 and 61 tokens; the opt-in float16 KV cache
keeps the promise too. Session tiers and transports
have their own tests (test_sessions.py, tests/server/test_seed_determinism.py).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from helpers import final_tokens

from ember.config import EngineConfig
from ember.engine.engine import LLMEngine
from ember.engine.sampling import SamplingParams

pytestmark = pytest.mark.timeout(900)

PROMPTS = [
    "Write a short poem about the sea.",
    "Explain photosynthesis to a child.",
    "Give me three tips for learning Python.",
    "What is 12 plus 30?",
    "Describe a cat in one sentence.",
    "Who wrote Romeo and Juliet? Answer with some background on the play.",
    "Name the largest ocean on Earth and say why it matters.",
    "Tell me a story about a lighthouse keeper.",
]
FILLERS = [f"Filler conversation {i}: list some facts about the number {i * 7}." for i in range(40)]
MAX_TOKENS = 16
MODES: dict[str, dict[str, str]] = {
    "int8 (default)": {},
    "float32": {"quantization": "none"},
    "int8, float16 KV cache": {"kv_cache_dtype": "float16"},
}
SAMPLINGS = ("greedy", "seeded")


def params(sampling: str, index: int) -> SamplingParams:
    if sampling == "greedy":
        return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.95, seed=1000 + index, ignore_eos=True)


def chat(engine: LLMEngine, text: str) -> list[int]:
    return engine.tokenizer.encode_chat([{"role": "user", "content": text}])


def run(engine: LLMEngine, arrivals: list[list[tuple[str, list[int], SamplingParams]]]) -> dict[str, tuple[list[int], int]]:
    """Add each arrival group one engine step after the previous; step to the end.

    Returns each request's tokens and its ``num_cached_tokens``.
    """
    outputs: dict[str, list] = {}
    pending = list(arrivals)
    while pending or engine.has_unfinished():
        if pending:
            for rid, ids, p in pending.pop(0):
                engine.add_request(rid, ids, p)
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return {rid: (final_tokens(outs), outs[-1].num_cached_tokens) for rid, outs in outputs.items()}


def make(loaded_model, mode: str, **overrides) -> LLMEngine:
    config = replace(EngineConfig(), kv_cache_bytes=256 * 1024 * 1024, **MODES[mode], **overrides)
    return LLMEngine(config=config, loaded=loaded_model)


@pytest.fixture(scope="module", params=list(MODES))
def mode(request):
    return request.param


@pytest.fixture(scope="module")
def alone(loaded_model, mode) -> dict[tuple[str, int], list[int]]:
    """Every prompt's tokens run alone (batch of one), on a fresh engine without a prefix cache."""
    engine = make(loaded_model, mode, enable_prefix_caching=False)
    assert engine.model.batch_invariant
    reference = {}
    for sampling in SAMPLINGS:
        for i, text in enumerate(PROMPTS):
            tokens, _ = run(engine, [[("r", chat(engine, text), params(sampling, i))]])["r"]
            assert len(tokens) == MAX_TOKENS
            reference[sampling, i] = tokens
    return reference


def assert_same(results, alone, sampling: str, label: str) -> None:
    mismatched = [i for i in range(len(PROMPTS)) if f"p{i}" in results and results[f"p{i}"][0] != alone[sampling, i]]
    assert not mismatched, f"{label}: prompts {mismatched} changed tokens"


@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("batch", [5, 16, 40])
def test_same_tokens_in_any_batch(loaded_model, mode, alone, sampling, batch):
    """Fillers start first; the prompts join one per step, so they sit at different offsets of busy steps."""
    engine = make(loaded_model, mode, enable_prefix_caching=False)
    tested = PROMPTS[: min(batch, len(PROMPTS))]
    fillers = FILLERS[: batch - len(tested)]
    arrivals = [[(f"f{j}", chat(engine, t), params(sampling, 100 + j)) for j, t in enumerate(fillers)]]
    arrivals += [[(f"p{i}", chat(engine, t), params(sampling, i))] for i, t in enumerate(tested)]
    results = run(engine, arrivals)
    assert len(results) == batch
    assert_same(results, alone, sampling, f"batch of {batch}")


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_same_tokens_from_the_prefix_cache_among_other_streams(loaded_model, mode, alone, sampling):
    """Each prompt runs once to fill the cache, then again beside 8 fresh streams: its prompt now comes from the cache."""
    engine = make(loaded_model, mode)
    first = run(engine, [[(f"p{i}", chat(engine, t), params(sampling, i))] for i, t in enumerate(PROMPTS)])
    assert_same(first, alone, sampling, "first run")
    others = [(f"f{j}", chat(engine, t), params(sampling, 200 + j)) for j, t in enumerate(FILLERS[:8])]
    again = run(engine, [others] + [[(f"p{i}", chat(engine, t), params(sampling, i))] for i, t in enumerate(PROMPTS)])
    for i in range(len(PROMPTS)):
        assert again[f"p{i}"][1] >= engine.kv.block_size, f"prompt {i} did not hit the prefix cache"
    assert_same(again, alone, sampling, "prefix-cache hit")


@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("chunk", [7, 61])
def test_same_tokens_whatever_the_prefill_chunks(loaded_model, mode, alone, sampling, chunk):
    """Prompts cut into chunks of ``chunk`` tokens, beside each other's decodes."""
    engine = make(loaded_model, mode, enable_prefix_caching=False, max_num_batched_tokens=chunk)
    results = run(engine, [[(f"p{i}", chat(engine, t), params(sampling, i)) for i, t in enumerate(PROMPTS)]])
    assert_same(results, alone, sampling, f"chunks of {chunk}")
