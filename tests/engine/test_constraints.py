"""engine/constraints.py in a real engine: masks, a batch of constrained and free rows, rollback."""

from __future__ import annotations

import json

import pytest
import torch

from ember.engine.constraints import GrammarSpec, InvalidGrammarError, fill_token_masks
from ember.engine.request import FinishReason, Request
from ember.engine.sampler import Sampler
from ember.engine.sampling import SamplingParams
from helpers import final_text, run_all

pytestmark = pytest.mark.timeout(300)
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "ok": {"type": "boolean"}}, "required": ["n", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine()


def test_mixed_batch_constrained_rows_follow_the_schema_free_rows_do_not_change(engine):
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "Say something."}])
    free = SamplingParams(max_tokens=12, temperature=0.8, seed=5)
    engine.add_request("alone", prompt, free)
    alone = final_text(run_all(engine)["alone"])
    for i in range(3):
        engine.add_request(f"json{i}", prompt, SamplingParams(max_tokens=40, temperature=0.8, seed=i), constraint=engine.grammar.compile(GrammarSpec.json_schema(SCHEMA)))
    engine.add_request("free", prompt, free)
    outputs = run_all(engine)
    assert final_text(outputs["free"]) == alone  # a free row beside constrained ones samples as it would alone
    for i in range(3):
        assert outputs[f"json{i}"][-1].finish_reason == FinishReason.STOP  # the grammar ended it, no EOS needed
        value = json.loads(final_text(outputs[f"json{i}"]))
        assert set(value) == {"n", "ok"} and 0 <= value["n"] <= 9


def test_mask_and_sampler_allow_only_grammar_tokens(engine):
    constraint = engine.grammar.compile(GrammarSpec.json_object())
    request = Request("m", [1, 2], SamplingParams(temperature=1.0, seed=0), 0.0, max_model_len=100, constraint=constraint)
    other = Request("f", [1, 2], SamplingParams(temperature=0.0), 0.0, max_model_len=100)
    vocab = engine.model_config.vocab_size
    masks = fill_token_masks([other.constraint, request.constraint], vocab)
    assert masks.rows == [1]
    allowed = masks.allowed[0]
    brace = engine.tokenizer.encode("{", add_bos=False)[0]
    assert allowed[brace] and not allowed[engine.tokenizer.encode("hello", add_bos=False)[0]]
    logits = torch.zeros(2, vocab)
    logits[:, engine.tokenizer.encode("hello", add_bos=False)[0]] = 50.0  # the model would say hello
    tokens, _ = Sampler()(logits, [other, request], masks)
    assert tokens[0] == engine.tokenizer.encode("hello", add_bos=False)[0]
    assert allowed[tokens[1]]


def test_rollback_undoes_accepted_tokens(engine):
    constraint = engine.grammar.compile(GrammarSpec.json_schema(SCHEMA))
    ids = engine.tokenizer.encode('{"n":3,"ok":true}', add_bos=False)
    assert all(constraint.accept(t) for t in ids) and constraint.is_terminated()
    constraint.rollback(2)
    assert not constraint.is_terminated() and constraint.num_accepted == len(ids) - 2
    assert all(constraint.accept(t) for t in ids[-2:]) and constraint.is_terminated()
    with pytest.raises(ValueError):
        constraint.rollback(len(ids) + 1)
    assert not engine.grammar.compile(GrammarSpec.json_schema(SCHEMA)).accept(engine.tokenizer.encode("[", add_bos=False)[0])


def test_logit_bias_and_bad_grammars(engine):
    bias_to = engine.tokenizer.encode(" banana", add_bos=False)[0]
    request = Request("b", [1], SamplingParams(temperature=0.0, logit_bias={bias_to: 100.0}), 0.0, max_model_len=100)
    tokens, _ = Sampler()(torch.randn(1, engine.model_config.vocab_size), [request])
    assert tokens == [bias_to]
    with pytest.raises(InvalidGrammarError) as info:
        engine.grammar.compile(GrammarSpec.json_schema({"type": "objec"}), "response_format.json_schema.schema")
    assert info.value.param == "response_format.json_schema.schema"
