"""Speculative decoding: where drafts come from, how their length adapts, and that they never change a token."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import pytest
from helpers import final_tokens, greedy, run_all

from ember.config import EngineConfig
from ember.engine.engine import LLMEngine
from ember.engine.sampling import SamplingParams
from ember.engine.speculation import PAUSE_STEPS, START_TOKENS, STEP_ROWS, Draft, Match, NgramIndex, RequestSpeculation, share_draft_rows

# -- where drafts come from (pure) -------------------------------------------------


def test_ngram_lookup_takes_the_longest_match_and_never_the_tail_itself():
    index = NgramIndex(1, 3, [5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7])
    # The tail (6, 7) was followed by 8 and by 9; the latest earlier occurrence wins.
    assert index.propose(index.tokens, 3) == Match([9, 2, 6], 7, 2)
    # The 3-gram (1, 6, 7) beats the 2-gram (6, 7): it was followed by 9 only.
    assert index.propose([1, 6, 7], 2) == Match([9, 2], 7, 3)
    # The n-gram that ends the list has no follower yet: nothing to propose from it alone.
    assert NgramIndex(1, 2, [4, 5]).propose([4, 5], 3) == Match([], -1, 0)
    assert NgramIndex(2, 3, [1, 2, 3]).propose([9, 3], 3) == Match([], -1, 0)  # below min_n


def test_a_prediction_is_read_in_order():
    index = NgramIndex(1, 2, [10, 11, 12, 10, 11, 13])
    assert index.propose([10, 11], 2, after=0) == Match([12, 10], 2, 2)  # the first occurrence at or after the cursor
    assert index.propose([10, 11], 2, after=3) == Match([13], 5, 2)
    assert index.propose([10, 11], 2, after=6) == Match([13], 5, 2)  # past the last: the latest


def test_draft_length_adapts_event_by_event():
    spec = RequestSpeculation(4, 1, 2)
    tokens = [9, 8, 1, 2, 3, 4, 5, 6, 7, 9, 8]  # the tail (9, 8) was followed by 1 2 3 4 ...

    def draft_len() -> int:
        draft = spec.propose(tokens, 100)
        return 0 if draft is None else len(draft.tokens)

    assert draft_len() == START_TOKENS == 2
    spec.record(Draft([1, 2]), 2)  # taken in full: double
    assert draft_len() == 4
    spec.record(Draft([3, 1, 2, 3]), 0)  # first token rejected: halve
    assert draft_len() == 2
    spec.record(Draft([3, 1]), 2)  # taken in full: double, up to the maximum
    assert draft_len() == 4
    spec.record(Draft([3, 1, 2, 3]), 2)  # partly taken: keep
    assert draft_len() == 4
    for length in (4, 2, 1):
        spec.record(Draft([0] * length), 0)
    assert [draft_len() for _ in range(PAUSE_STEPS)] == [0] * PAUSE_STEPS  # at zero: pause
    assert draft_len() == 1  # then try one token again
    assert spec.propose(tokens, 0) is None  # never past the request's limit
    assert (spec.drafted, spec.accepted) == (2 + 4 + 2 + 4 + 7, 2 + 0 + 2 + 2)


def test_prediction_counters():
    spec = RequestSpeculation(4, 2, 3, prediction=[7, 8, 9, 10, 11])
    draft = spec.propose([1, 7], 4)  # one token places the answer in its prediction
    assert draft == Draft([8, 9], from_prediction=True, start=1)
    spec.record(draft, 2)
    assert (spec.accepted_from_prediction, spec.rejected_prediction_tokens) == (2, 3)
    assert spec.propose([1, 7, 8, 9], 4) == Draft([10, 11], from_prediction=True, start=3)
    # The answer's own text wins when it matches a longer n-gram than the prediction does.
    own = RequestSpeculation(4, 2, 3, prediction=[5, 6, 1])
    assert own.propose([4, 5, 6, 2, 4, 5, 6], 4) == Draft([2, 4], start=3)
    unused = RequestSpeculation(0, 2, 3, prediction=[7, 8, 9])  # a constrained request: never drafts
    assert unused.propose([7, 8], 4) is None and unused.rejected_prediction_tokens == 3


# -- never changes a token (engine, default int8 mode) ----------------------------

PARAGRAPH = (
    "The quick brown fox jumps over the lazy dog. It was a bright cold day in April, and the clocks were striking thirteen. "
    "Winston Smith, his chin nuzzled into his breast in an effort to escape the vile wind, slipped quickly through the glass "
    "doors of Victory Mansions, though not quickly enough to prevent a swirl of gritty dust from entering along with him."
)
CODE = "def area(width, height):\n    result = width * height\n    return result\n\n\ndef perimeter(width, height):\n    return 2 * (width + height)\n"
PROMPTS = [
    "Rewrite this paragraph with the spelling fixed: " + PARAGRAPH.replace("quick", "quikc").replace("bright", "brigth"),
    "Add type hints to this function:\n" + CODE,
    "Repeat exactly: one two three four five six seven eight nine ten.",
    "Write a short story about a dragon.",
    "What is the capital of France?",
    "List the planets of the solar system.",
    "Summarize, quoting the first sentence: " + PARAGRAPH,
    "Translate 'good morning' into Spanish, French and German.",
]


@pytest.fixture(scope="module")
def engines(loaded_model):
    config = EngineConfig(kv_cache_bytes=96 << 20)
    plain = LLMEngine(config=replace(config, num_speculative_tokens=0), loaded=loaded_model)
    speculating = LLMEngine(config=config, loaded=loaded_model)
    assert speculating.num_speculative_tokens > 0
    return plain, speculating


def _run(engine: LLMEngine, params: list[SamplingParams], prompts: list[str] = PROMPTS, together: bool = True, **kwargs) -> list[list[int]]:
    engine.kv.pool.reset_prefix_cache()
    ids = [engine.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    outs: list[list[int]] = []
    if together:
        for i, (prompt, p) in enumerate(zip(ids, params, strict=True)):
            engine.add_request(f"r{i}", prompt, p, **kwargs)
        done = run_all(engine)
        return [final_tokens(done[f"r{i}"]) for i in range(len(ids))]
    for i, (prompt, p) in enumerate(zip(ids, params, strict=True)):
        engine.add_request(f"r{i}", prompt, p, **kwargs)
        outs.append(final_tokens(run_all(engine)[f"r{i}"]))
    return outs


@pytest.mark.timeout(600)
def test_greedy_output_is_identical_with_speculation_alone_and_in_a_batch_of_8(engines):
    plain, speculating = engines
    params = [greedy(64) for _ in PROMPTS]
    reference = _run(plain, params, together=False)
    before = (speculating.stats.draft_tokens, speculating.stats.accepted_draft_tokens)
    alone = _run(speculating, params, together=False)
    batch = _run(speculating, params, together=True)
    assert alone == reference
    assert batch == reference
    drafted, accepted = speculating.stats.draft_tokens - before[0], speculating.stats.accepted_draft_tokens - before[1]
    print(f"\ngreedy: {accepted}/{drafted} drafted tokens accepted over {2 * len(PROMPTS)} requests")
    assert accepted > 50  # the input-grounded prompts did speculate: the identity above is not vacuous


@pytest.mark.timeout(600)
def test_seeded_sampling_gives_the_tokens_of_plain_decoding(engines):
    plain, speculating = engines
    params = [SamplingParams(max_tokens=48, temperature=0.8, top_p=0.95, seed=1000 + i) for i in range(len(PROMPTS))]
    reference = _run(plain, params)
    before = speculating.stats.accepted_draft_tokens
    first = _run(speculating, params)
    second = _run(speculating, params, together=False)
    assert first == reference and second == reference
    assert speculating.stats.accepted_draft_tokens - before > 20


@pytest.mark.timeout(600)
def test_a_prediction_is_drafted_from_and_changes_nothing(engines):
    plain, speculating = engines
    prompt = [PROMPTS[0]]
    reference = _run(plain, [greedy(64)], prompt)[0]
    answer = plain.tokenizer.decode(reference)
    speculating.add_request(
        "p", speculating.tokenizer.encode_chat([{"role": "user", "content": prompt[0]}]), greedy(64), prediction=reference
    )
    outs = run_all(speculating)["p"]
    assert final_tokens(outs) == reference, answer
    last = outs[-1].speculation
    assert last is not None and last.accepted_prediction_tokens is not None
    assert last.accepted_prediction_tokens > len(reference) // 2
    assert last.rejected_prediction_tokens == len(reference) - last.accepted_prediction_tokens
    assert last.accepted_tokens >= last.accepted_prediction_tokens
    # A wrong prediction costs nothing but its rejected tokens.
    wrong = speculating.tokenizer.encode("Completely unrelated text about gardening and tomatoes.", add_bos=False)
    speculating.add_request("w", speculating.tokenizer.encode_chat([{"role": "user", "content": prompt[0]}]), greedy(64), prediction=wrong)
    outs = run_all(speculating)["w"]
    assert final_tokens(outs) == reference
    last = outs[-1].speculation
    assert last is not None and last.accepted_prediction_tokens is not None
    assert last.rejected_prediction_tokens == len(wrong) - last.accepted_prediction_tokens


def _chi_square_p_value(a: Counter[int], b: Counter[int]) -> float:
    """Two-sample chi-square test of homogeneity on token counts (rare tokens pooled)."""
    na, nb = sum(a.values()), sum(b.values())
    common = [t for t in set(a) | set(b) if a[t] + b[t] >= 10]
    cells = [(a[t], b[t]) for t in common]
    cells.append((na - sum(x for x, _ in cells), nb - sum(y for _, y in cells)))
    cells = [c for c in cells if sum(c) > 0]
    stat = 0.0
    for x, y in cells:
        total = x + y
        ea, eb = total * na / (na + nb), total * nb / (na + nb)
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    dof = len(cells) - 1
    # Wilson-Hilferty: the chi-square tail through a normal approximation (dof >= 1).
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.timeout(600)
def test_sampled_distribution_is_the_models(engines):
    """Tokens drawn through accepted drafts follow the model's distribution.

    Two independent arms (different seeds), 160 draws each at temperature 0.5
    of the 4th answer token of one prompt, with and without speculation; the
    prediction (the greedy answer) sends most 2nd-4th tokens through verify
    rows in the speculating arm (measured: ~260 draft tokens accepted, ~17
    distinct 4th tokens). Their token frequencies must agree (chi-square, p > 0.001).
    """
    plain, speculating = engines
    prompt = "Count from 1 to 20, separated by commas."
    reference = _run(plain, [greedy(8)], [prompt])[0]
    n = 160

    def fourth_tokens(engine: LLMEngine, seed0: int, **kwargs) -> Counter[int]:
        # Four at a time: a step has draft rows to spare only beside a few decodes (STEP_ROWS).
        counts: Counter[int] = Counter()
        for first in range(0, n, 4):
            params = [SamplingParams(max_tokens=5, temperature=0.5, seed=seed0 + first + i, ignore_eos=True) for i in range(4)]
            counts.update(out[3] for out in _run(engine, params, [prompt] * 4, **kwargs))
        return counts

    before = speculating.stats.accepted_draft_tokens
    with_spec = fourth_tokens(speculating, 0, prediction=reference)
    accepted = speculating.stats.accepted_draft_tokens - before
    without = fourth_tokens(plain, 10_000)
    p = _chi_square_p_value(with_spec, without)
    print(f"\n4th token over {n} seeds: {len(with_spec)} vs {len(without)} distinct, p = {p:.3f}; {accepted} draft tokens accepted")
    assert accepted > n  # most draws did go through verify rows
    assert len(with_spec) > 3  # not a degenerate distribution
    assert p > 0.001


def test_draft_rows_fill_a_step_up_to_its_cheap_rows():
    assert share_draft_rows([8], 1) == [8]
    assert STEP_ROWS == 16
    assert share_draft_rows([8, 8, 8], 3) == [8, 5, 0]  # 13 rows left for drafts
    assert share_draft_rows([0, 8], 2) == [0, 8]  # a paused request takes nothing
    assert share_draft_rows([8] * 16, 16) == [0] * 16  # 16 streams: no drafts
