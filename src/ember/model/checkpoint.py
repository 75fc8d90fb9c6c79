"""The contract between a checkpoint reader and the loading pipeline.

A reader (``gguf_source.py``, ``hf_source.py``) turns one on-disk format into a
``Checkpoint``: hyperparameters, tensors under Ember's internal names, and what the
tokenizer needs. Everything else — the rotary layout, tied embeddings, the shape
check, the fingerprint — is done once, by ``loader.assemble``.

Internal tensor names:

    embed, norm, lm_head (absent when tied)
    layers.{i}.{attn_norm, q, k, v, q_bias, k_bias, v_bias, o, o_bias (optional), ffn_norm, gate, up, down}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


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
class Hyperparameters:
    """The architecture numbers a checkpoint declares (``vocab_size`` is the embedding's rows)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    rope_llama3_scaling: tuple[float, float, float, int] | None = None


@dataclass
class Checkpoint:
    """One model as a reader found it, before the pipeline's common steps."""

    name: str
    path: str
    files: list[str]  # the weight files: their bytes are the model's fingerprint
    format: str  # "gguf" or "hf"
    arch: str
    hyperparameters: Hyperparameters
    weights: dict[str, torch.Tensor]  # float32, internal names
    # q/k rows in the NeoX half-split layout (HF checkpoints, GGUF qwen2): permuted at load.
    half_split_qk: bool
    # The checkpoint says input and output embeddings are one matrix (also implied by no lm_head).
    ties_embeddings: bool
    tokenizer: TokenizerSource
    generation_defaults: dict[str, float] = field(default_factory=dict)
