"""Read a GGUF file (llama.cpp's format) into a ``Checkpoint``: metadata, vocabulary, dequantized weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ember.errors import ModelFormatError
from ember.model.checkpoint import Checkpoint, Hyperparameters, TokenizerSource
from ember.model.tensor_names import internal_name

SUPPORTED_GGUF_ARCHS = ("llama", "qwen2")

_TOP_LEVEL = {"token_embd.weight": "embed", "output_norm.weight": "norm", "output.weight": "lm_head"}
_LAYER_NAMES = {
    "attn_norm.weight": "attn_norm",
    "attn_q.weight": "q",
    "attn_k.weight": "k",
    "attn_v.weight": "v",
    "attn_q.bias": "q_bias",
    "attn_k.bias": "k_bias",
    "attn_v.bias": "v_bias",
    "attn_output.weight": "o",
    "attn_output.bias": "o_bias",
    "ffn_norm.weight": "ffn_norm",
    "ffn_gate.weight": "gate",
    "ffn_up.weight": "up",
    "ffn_down.weight": "down",
}
# Sampling fields a model may recommend, by their names in Ember (SamplingParams).
_SAMPLING_KEYS = {
    "temperature": "general.sampling.temp",
    "top_p": "general.sampling.top_p",
    "top_k": "general.sampling.top_k",
    "min_p": "general.sampling.min_p",
    "repetition_penalty": "general.sampling.penalty_repeat",
}


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def read_gguf(path: str) -> Checkpoint:
    """The checkpoint in a GGUF file; raises ``ModelFormatError`` naming what is wrong with it."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # the gguf package raises ValueError, struct.error, ...
        raise ModelFormatError(
            f"{path!r} is not a readable GGUF file ({type(exc).__name__}: {exc}). "
            "The file may be truncated or corrupt; download or copy it again."
        ) from exc

    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise ModelFormatError(f"GGUF architecture {arch!r} is not supported; Ember runs {', '.join(SUPPORTED_GGUF_ARCHS)}.")

    def meta(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    try:
        hidden = int(meta("embedding_length"))
        num_heads = int(meta("attention.head_count"))
        num_layers = int(meta("block_count"))
        ffn = int(meta("feed_forward_length"))
    except TypeError as exc:
        raise ModelFormatError(f"{path!r} lacks required {arch}.* metadata.") from exc
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise ModelFormatError(f"{path!r} has no tokenizer vocabulary (tokenizer.ggml.tokens).")
    hyper = Hyperparameters(
        hidden_size=hidden,
        intermediate_size=ffn,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(meta("attention.head_count_kv", num_heads)),
        head_dim=int(meta("attention.key_length", hidden // num_heads)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(meta("context_length", 2048)),
    )

    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = internal_name(tensor.name, _TOP_LEVEL, "blk.", _LAYER_NAMES)
        if name is not None:
            weights[name] = _dequantize(tensor)
    if "embed" not in weights:
        raise ModelFormatError(f"{path!r} has no token_embd.weight tensor.")

    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    eot = _field(reader, "tokenizer.ggml.eot_token_id")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    tokenizer = TokenizerSource(
        gguf_vocab={
            "model": _field(reader, "tokenizer.ggml.model", "gpt2"),
            "pre": _field(reader, "tokenizer.ggml.pre", "default"),
            "tokens": list(tokens),
            "merges": list(_field(reader, "tokenizer.ggml.merges", []) or []),
            "token_types": [int(x) for x in (_field(reader, "tokenizer.ggml.token_type", []) or [])],
            "scores": [float(x) for x in (_field(reader, "tokenizer.ggml.scores", []) or [])],
        },
        chat_template=_field(reader, "tokenizer.chat_template"),
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=tuple(sorted({int(x) for x in (eos, eot) if x is not None})),
        add_bos_token=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
    )
    defaults = {name: _field(reader, key) for name, key in _SAMPLING_KEYS.items()}
    return Checkpoint(
        name=str(_field(reader, "general.name") or Path(path).stem),
        path=path,
        files=[path],
        format="gguf",
        arch=arch,
        hyperparameters=hyper,
        weights=weights,
        half_split_qk=arch == "qwen2",  # llama.cpp stores llama q/k interleaved, qwen2 half-split
        ties_embeddings="lm_head" not in weights,
        tokenizer=tokenizer,
        generation_defaults={name: float(v) for name, v in defaults.items() if isinstance(v, (int, float))},
    )


def _dequantize(tensor: Any) -> torch.Tensor:
    import gguf

    try:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ModelFormatError(
            f"Tensor {tensor.name} uses GGUF type {tensor.tensor_type.name}, which cannot be "
            "dequantized; use a Q4_0, Q4_1, Q8_0, F16 or F32 file."
        ) from exc
    # GGUF shapes list the fastest dimension first; numpy's are row-major.
    shape = tuple(int(d) for d in reversed(tensor.shape))
    array = np.ascontiguousarray(array, dtype=np.float32)
    if not array.flags.writeable:  # F32 tensors are views of the read-only memory map
        array = array.copy()
    return torch.from_numpy(array.reshape(shape))
