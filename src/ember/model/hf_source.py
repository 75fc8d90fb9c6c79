"""Read a Hugging Face model directory (config.json + *.safetensors + tokenizer.json) into a ``Checkpoint``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from ember.errors import ModelFormatError, ModelNotFoundError
from ember.model.checkpoint import Checkpoint, Hyperparameters, TokenizerSource
from ember.model.tensor_names import internal_name

SUPPORTED_HF_TYPES = ("llama", "mistral", "qwen2")

_TOP_LEVEL = {"embed_tokens.weight": "embed", "norm.weight": "norm", "lm_head.weight": "lm_head"}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "q",
    "self_attn.k_proj.weight": "k",
    "self_attn.v_proj.weight": "v",
    "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
    "self_attn.o_proj.weight": "o",
    "self_attn.o_proj.bias": "o_bias",
    "post_attention_layernorm.weight": "ffn_norm",
    "mlp.gate_proj.weight": "gate",
    "mlp.up_proj.weight": "up",
    "mlp.down_proj.weight": "down",
}
_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _read_json(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def read_hf_directory(path: str) -> Checkpoint:
    """The checkpoint in a Llama/Mistral/Qwen2 directory; raises a named error for what is missing."""
    from safetensors import safe_open

    try:
        hf = _read_json(os.path.join(path, "config.json"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelFormatError(f"{path}/config.json is unreadable: {exc}") from exc
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_HF_TYPES:
        raise ModelFormatError(
            f"model_type {model_type!r} in {path}/config.json is not supported; Ember runs {', '.join(SUPPORTED_HF_TYPES)}."
        )
    files = sorted(str(p) for p in Path(path).glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{path!r} has no *.safetensors weights (PyTorch .bin files are not loaded).")
    tokenizer_json = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tokenizer_json):
        raise ModelNotFoundError(f"{path!r} has no tokenizer.json.")

    weights: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as st:
                for key in st.keys():  # noqa: SIM118 (safe_open is not iterable)
                    name = internal_name(key.removeprefix("model."), _TOP_LEVEL, "layers.", _LAYER_NAMES)
                    if name is not None:
                        weights[name] = st.get_tensor(key).to(torch.float32)
        except Exception as exc:
            raise ModelFormatError(f"{file!r} is not a readable safetensors file: {exc}") from exc

    tok_config: dict[str, Any] = {}
    tc_path = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(tc_path):
        tok_config = _read_json(tc_path)
    chat_template = tok_config.get("chat_template")
    jinja_path = os.path.join(path, "chat_template.jinja")
    if chat_template is None and os.path.isfile(jinja_path):
        chat_template = Path(jinja_path).read_text(encoding="utf-8")
    bos_id = hf.get("bos_token_id")
    tokenizer = TokenizerSource(
        tokenizer_json_path=tokenizer_json,
        chat_template=chat_template,
        bos_token_id=int(bos_id) if isinstance(bos_id, int) else None,
        eos_token_ids=_eos_ids(path, hf, tok_config, tokenizer_json),
        add_bos_token=bool(tok_config.get("add_bos_token", False)),
    )
    return Checkpoint(
        name=Path(path).name,
        path=path,
        files=files,
        format="hf",
        arch=model_type,
        hyperparameters=_hyperparameters(hf),
        weights=weights,
        half_split_qk=True,  # Hugging Face keeps the NeoX layout
        ties_embeddings=bool(hf.get("tie_word_embeddings", False)),
        tokenizer=tokenizer,
        generation_defaults=_generation_defaults(path),
    )


def _hyperparameters(hf: dict[str, Any]) -> Hyperparameters:
    num_heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters")
    rope_type = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    llama3 = None
    if isinstance(scaling, dict) and rope_type == "llama3":
        llama3 = (
            float(scaling["factor"]),
            float(scaling["low_freq_factor"]),
            float(scaling["high_freq_factor"]),
            int(scaling["original_max_position_embeddings"]),
        )
    elif rope_type not in (None, "default"):
        raise ModelFormatError(f"rope_scaling {scaling!r} is not supported (plain and llama3 RoPE are).")
    rope_theta = hf.get("rope_theta")
    if rope_theta is None and isinstance(scaling, dict):
        rope_theta = scaling.get("rope_theta")
    return Hyperparameters(
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(hf.get("head_dim") or hidden // num_heads),
        rope_theta=float(rope_theta or 10000.0),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        rope_llama3_scaling=llama3,
    )


def _token_ids(value: Any) -> set[int]:
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {int(x) for x in value}
    return set()


def _eos_ids(path: str, hf: dict[str, Any], tok_config: dict[str, Any], tokenizer_json: str) -> tuple[int, ...]:
    """Every end-of-sequence id the directory names: config, generation config, the tokenizer's eos token."""
    ids = _token_ids(hf.get("eos_token_id"))
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        ids |= _token_ids(_read_json(gen_path).get("eos_token_id"))
    eos_token = tok_config.get("eos_token")
    if isinstance(eos_token, dict):
        eos_token = eos_token.get("content")
    if isinstance(eos_token, str):
        for added in _read_json(tokenizer_json).get("added_tokens", []):
            if added.get("content") == eos_token:
                ids.add(int(added["id"]))
    return tuple(sorted(ids))


def _generation_defaults(path: str) -> dict[str, float]:
    """The sampling values of generation_config.json; none when it asks for greedy decoding only."""
    try:
        gen = _read_json(os.path.join(path, "generation_config.json"))
    except (OSError, json.JSONDecodeError):
        return {}
    if gen.get("do_sample") is False:
        return {"temperature": 0.0}
    return {k: float(gen[k]) for k in _SAMPLING_KEYS if isinstance(gen.get(k), (int, float)) and not isinstance(gen.get(k), bool)}
