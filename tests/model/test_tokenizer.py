"""The GGUF-built tokenizer and chat template agree with transformers'."""

from __future__ import annotations

import pytest

from ember.model.tokenizer import Tokenizer, cache_dir

SAMPLES = [
    "Hello, world!",
    "The year 2024 had 366 days; 3.14159 is pi.",
    "  leading spaces and\ttabs\nnew lines\n\n",
    "def f(x):\n    return x ** 2  # square",
    "Café naïve 東京 🤖🔥 Ωmega",
    "<|im_start|>user\nhi<|im_end|>",
    "I'm sure you'll see they've done it; we'd go.",
    "ALLCAPS and MiXeD CaSe 123abc456",
]


@pytest.mark.parametrize("text", SAMPLES)
def test_encode_matches_transformers(fp32_engine, hf_reference, text):
    _, hf_tok = hf_reference
    assert fp32_engine.tokenizer.encode(text) == hf_tok.encode(text, add_special_tokens=False)
    assert fp32_engine.tokenizer.decode(fp32_engine.tokenizer.encode(text), skip_special_tokens=False) == text


def test_chat_template_matches_transformers(fp32_engine, hf_reference):
    _, hf_tok = hf_reference
    for messages in (
        [{"role": "user", "content": "Hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
    ):
        ours = fp32_engine.tokenizer.render_chat(messages)
        theirs = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours == theirs


def test_special_tokens_and_eos_from_metadata(fp32_engine):
    tok = fp32_engine.tokenizer
    assert tok.eos_token_ids == (2,) and tok.id_to_token(2) == "<|im_end|>"
    assert tok.encode("<|im_end|>") == [2]
    assert tok.decode([2], skip_special_tokens=True) == ""


def test_built_tokenizer_is_cached_by_file_hash(loaded_model, tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    Tokenizer(loaded_model.tokenizer)
    cached = tmp_path / "tokenizers" / f"{loaded_model.fingerprint}.json"
    assert cached.is_file() and cache_dir() == tmp_path
    again = Tokenizer(loaded_model.tokenizer)  # loads the cached file
    assert again.encode("Hello 123") == Tokenizer(loaded_model.tokenizer).encode("Hello 123")


def test_template_sandbox_blocks_python_internals(loaded_model):
    from dataclasses import replace

    from ember.errors import ModelFormatError

    hostile = replace(loaded_model.tokenizer, chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}")
    tok = Tokenizer(hostile)
    with pytest.raises(Exception) as info:
        tok.render_chat([{"role": "user", "content": "x"}])
    assert "unsafe" in str(info.value).lower() or "access" in str(info.value).lower()
    with pytest.raises(ModelFormatError):
        Tokenizer(replace(loaded_model.tokenizer, chat_template="{% for %}"))
