"""Clear, named errors for the mistakes users make."""

from __future__ import annotations

import pytest

from ember.engine.sampling import SamplingParams
from ember.errors import ContextLengthExceededError, InvalidSamplingParamsError, ModelFormatError, ModelNotFoundError
from ember.model.loader import load_model


def test_prompt_longer_than_context(fp32_engine):
    n = fp32_engine.max_model_len
    with pytest.raises(ContextLengthExceededError) as info:
        fp32_engine.add_request("too-long", [5] * (n + 10), SamplingParams(max_tokens=4))
    assert str(n) in str(info.value) and str(n + 10) in str(info.value)
    with pytest.raises(ContextLengthExceededError) as info:
        fp32_engine.add_request("too-much", [5] * (n - 10), SamplingParams(max_tokens=100))
    assert info.value.max_tokens == 100
    assert not fp32_engine.has_unfinished()


def test_empty_prompt_and_bad_token_ids(fp32_engine):
    with pytest.raises(InvalidSamplingParamsError):
        fp32_engine.add_request("empty", [], SamplingParams())
    with pytest.raises(InvalidSamplingParamsError):
        fp32_engine.add_request("oov", [10**9], SamplingParams())


def test_unknown_model_path_names_the_path(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelNotFoundError) as info:
        load_model(str(missing))
    assert str(missing) in str(info.value)


def test_directory_without_model(tmp_path):
    with pytest.raises(ModelNotFoundError):
        load_model(str(tmp_path))


@pytest.mark.parametrize("content", [b"", b"GGUF\x03\x00\x00\x00garbage", b"not a model at all"])
def test_corrupt_gguf(tmp_path, content):
    path = tmp_path / "broken.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelFormatError) as info:
        load_model(str(path))
    assert "broken.gguf" in str(info.value)


def test_truncated_gguf(tmp_path):
    from ember.model.loader import embedded_model_path

    data = open(embedded_model_path(), "rb").read(3_000_000)
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data)
    with pytest.raises(ModelFormatError):
        load_model(str(path))
