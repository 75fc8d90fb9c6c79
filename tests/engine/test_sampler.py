"""Sampler: greedy, seeds, top-k/top-p/min-p, penalties, min_tokens, logprobs."""

from __future__ import annotations

import pytest
import torch

from ember.engine.request import Request
from ember.engine.sampler import Sampler, _top_p
from ember.engine.sampling import SamplingParams
from ember.errors import InvalidSamplingParamsError
from helpers import final_tokens, greedy, run_all


def make_request(params: SamplingParams, tokens=(1, 2, 3), outputs=()) -> Request:
    r = Request("s", list(tokens), params, 0.0, eos_token_ids=(2,), max_model_len=1000)
    r.token_ids.extend(outputs)
    return r


def test_greedy_picks_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2, -1.0], [5.0, 0.0, 0.0, 0.0]])
    tokens, _ = Sampler()(logits, [make_request(SamplingParams(temperature=0)), make_request(SamplingParams(temperature=0))])
    assert tokens == [1, 0]


def test_top_k_one_is_greedy_even_at_high_temperature():
    logits = torch.randn(1, 50)
    for seed in range(5):
        tokens, _ = Sampler()(logits, [make_request(SamplingParams(temperature=2.0, top_k=1, seed=seed))])
        assert tokens == [int(logits.argmax())]


def test_top_p_keeps_smallest_set_reaching_mass():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    kept = _top_p(probs, 0.7)
    assert kept.tolist() == pytest.approx([0.5, 0.3, 0.0, 0.0])
    assert _top_p(probs, 0.5).tolist() == pytest.approx([0.5, 0.0, 0.0, 0.0])
    # Beyond the candidate window, the full sort gives the same answer.
    flat = torch.full((5000,), 1 / 5000)
    assert int((_top_p(flat, 0.9) > 0).sum()) == 4500


def test_min_p_drops_unlikely_tokens():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.05, 0.05]]))
    seen = set()
    for seed in range(40):
        tokens, _ = Sampler()(logits, [make_request(SamplingParams(temperature=1.0, min_p=0.2, seed=seed))])
        seen.add(tokens[0])
    assert seen == {0, 1}


def test_seed_reproducible_and_distinct():
    logits = torch.randn(1, 1000)

    def draws(seed: int) -> list[int]:
        request = make_request(SamplingParams(temperature=1.0, seed=seed))
        return [Sampler()(logits, [request])[0][0] for _ in range(20)]

    assert draws(7) == draws(7)
    assert draws(8) != draws(7)


def test_penalties_follow_openai_semantics():
    logits = torch.tensor([[2.0, 2.0, 2.0, -1.0]])
    r = make_request(SamplingParams(temperature=0, frequency_penalty=0.5, presence_penalty=0.25), tokens=(3,), outputs=(0, 0, 1))
    row = logits[0].clone()
    Sampler._apply_penalties(row, r)
    assert row.tolist() == pytest.approx([2.0 - 1.0 - 0.25, 2.0 - 0.5 - 0.25, 2.0, -1.0])
    r = make_request(SamplingParams(temperature=0, repetition_penalty=2.0), tokens=(3,), outputs=(0,))
    row = logits[0].clone()
    Sampler._apply_penalties(row, r)
    assert row.tolist() == pytest.approx([1.0, 2.0, 2.0, -2.0])  # positive divided, negative multiplied


def test_min_tokens_masks_stop_tokens():
    logits = torch.tensor([[0.0, 0.0, 9.0, 1.0]])  # EOS (2) is the favourite
    r = make_request(SamplingParams(temperature=0, min_tokens=2))
    assert Sampler()(logits, [r])[0] == [3]
    r.token_ids.extend([5, 5])
    assert Sampler()(logits, [r])[0] == [2]


def test_logprobs_are_model_logprobs_with_top_alternatives():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    tokens, lps = Sampler()(logits, [make_request(SamplingParams(temperature=0, logprobs=2))])
    expected = torch.log_softmax(logits[0], -1)
    assert tokens == [2]
    assert lps[0].logprob == pytest.approx(float(expected[2]))
    assert [t for t, _ in lps[0].top] == [2, 1]


@pytest.mark.parametrize(
    "kwargs,param",
    [
        (dict(temperature=-1), "temperature"),
        (dict(temperature=3), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_k=-5), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_p=1.5), "min_p"),
        (dict(presence_penalty=3), "presence_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(logprobs=50), "top_logprobs"),
        (dict(min_tokens=10, max_tokens=5), "min_tokens"),
        (dict(stop=["x"] * 20), "stop"),
    ],
)
def test_invalid_values_raise_named_error(kwargs, param):
    with pytest.raises(InvalidSamplingParamsError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


@pytest.mark.timeout(300)
def test_seeded_sampling_is_batch_independent(fp32_engine):
    engine = fp32_engine
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": "Tell me a joke."}])
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234)
    engine.add_request("seeded-alone", ids, params)
    alone = final_tokens(run_all(engine)["seeded-alone"])
    engine.add_request("seeded-batched", ids, params)
    engine.add_request("other", engine.tokenizer.encode("Something else entirely"), greedy(12))
    batched = final_tokens(run_all(engine)["seeded-batched"])
    assert alone == batched


def test_tiny_temperature_is_greedy_not_nan():
    logits = torch.randn(1, 100) * 50
    for t in (1e-300, 5e-324, 1e-6):
        tokens, _ = Sampler()(logits, [make_request(SamplingParams(temperature=t, top_p=0.5, seed=1))])
        assert tokens == [int(logits.argmax())]


def test_extreme_penalties_stay_finite():
    logits = torch.randn(1, 100) * 30
    request = make_request(SamplingParams(temperature=1.5, repetition_penalty=0.01, frequency_penalty=2.0, presence_penalty=-2.0, seed=3),
                           tokens=tuple(range(50)), outputs=(1, 1, 2))
    tokens, _ = Sampler()(logits, [request])
    assert 0 <= tokens[0] < 100
