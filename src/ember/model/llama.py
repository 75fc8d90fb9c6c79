"""The Llama-family decoder, in one file: RMSNorm, RoPE, grouped-query attention, SwiGLU.

The forward pass works on a *flat* batch: the new tokens of every scheduled
sequence side by side, ``T`` in all, decode tokens first. Attention reads each
sequence's past from the paged KV cache (``engine/kv_cache.py``) through slot
indices that the runner prepares once per step (``AttentionMetadata``).

Shapes: ``T`` new tokens, ``D`` hidden size, ``H`` query heads, ``KV`` key/value
heads, ``G = H / KV`` queries per key head, ``Hd`` head dim, ``B`` decode
sequences, ``L`` padded context length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from ember.config import ModelConfig
from ember.model.quant import make_linear


@dataclass
class PrefillSegment:
    """Tokens ``[start, end)`` of the flat batch: one sequence's prompt chunk.

    ``context_slots`` holds the cache slots of the whole context (earlier tokens
    and this chunk, in order) when the sequence has earlier tokens in the cache;
    None when the chunk is the whole context so far (plain causal attention).
    ``mask`` (chunk, context) is True where a query may attend.
    """

    start: int
    end: int
    context_slots: torch.Tensor | None = None
    mask: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, shared by every layer.

    Invariant: tokens ``[0, num_decode_tokens)`` are decodes, one per sequence,
    and ``decode_slots[b]`` lists sequence ``b``'s context slots (its new token
    included), padded to a common length; ``decode_mask[b, 0, 0, j]`` is False
    on padding.
    """

    slot_mapping: torch.Tensor  # (T,) cache slot of each new token
    num_decode_tokens: int = 0
    decode_slots: torch.Tensor | None = None  # (B, L)
    decode_mask: torch.Tensor | None = None  # (B, 1, 1, L) bool
    prefills: list[PrefillSegment] = field(default_factory=list)


def rope_frequencies(config: ModelConfig, max_positions: int) -> torch.Tensor:
    """Complex rotations ``exp(i * pos * theta_j)``, shape (max_positions, Hd / 2)."""
    half = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, half, dtype=torch.float64) * 2 / config.head_dim))
    if config.rope_llama3_scaling is not None:
        inv_freq = _llama3_scale(inv_freq, *config.rope_llama3_scaling)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
    return torch.polar(torch.ones_like(angles), angles).to(torch.complex64)


def _llama3_scale(inv_freq: torch.Tensor, factor: float, low: float, high: float, original: int) -> torch.Tensor:
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = original / low, original / high
    smooth = (original / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(is_mid, mid, scaled)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of ``x`` (T, N, Hd) by ``freqs`` (T, 1, Hd/2).

    Pairs are adjacent dimensions (the layout ``loader.py`` guarantees), so one
    complex multiply does the rotation.
    """
    t, n, hd = x.shape
    pairs = x.float().reshape(t, n, hd // 2, 2) if x.dtype != torch.float32 else x.view(t, n, hd // 2, 2)
    rotated = torch.view_as_real(torch.view_as_complex(pairs) * freqs).view(t, n, hd)
    return rotated if x.dtype == torch.float32 else rotated.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Attention(nn.Module):
    """Grouped-query attention over the paged KV cache; q/k/v in one fused matmul."""

    def __init__(self, config: ModelConfig, w: dict[str, torch.Tensor], quantization: str, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = 1.0 / math.sqrt(config.head_dim)
        qkv_weight = torch.cat([w["q"], w["k"], w["v"]])
        qkv_bias = torch.cat([w["q_bias"], w["k_bias"], w["v_bias"]]) if config.attention_bias else None
        self.qkv = make_linear(qkv_weight, qkv_bias, quantization, dtype, device)
        self.o = make_linear(w["o"], w.get("o_bias"), quantization, dtype, device)

    def forward(
        self,
        x: torch.Tensor,  # (T, D)
        freqs: torch.Tensor,  # (T, 1, Hd/2)
        meta: AttentionMetadata,
        k_cache: torch.Tensor,  # (num_slots, KV, Hd)
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv(x)  # (T, q + 2 kv)
        qk = apply_rope(qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim), freqs)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]  # (T, H, Hd), (T, KV, Hd)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)

        outputs = []
        nd = meta.num_decode_tokens
        if nd:
            outputs.append(self._decode(q[:nd], meta, k_cache, v_cache))
        for seg in meta.prefills:
            outputs.append(self._prefill(q[seg.start : seg.end], k[seg.start : seg.end], v[seg.start : seg.end], seg, k_cache, v_cache))
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
        return self.o(out)  # (T, D)

    def _decode(self, q: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        b = q.shape[0]
        keys = k_cache[meta.decode_slots].transpose(1, 2)  # (B, KV, L, Hd)
        values = v_cache[meta.decode_slots].transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=meta.decode_mask, scale=self.scale, enable_gqa=True
        )  # (B, H, 1, Hd)
        return out.reshape(b, self.q_size)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: PrefillSegment, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        n = q.shape[0]
        if seg.context_slots is None:
            keys, values, mask, causal = k, v, None, True
        else:
            keys, values, mask, causal = k_cache[seg.context_slots], v_cache[seg.context_slots], seg.mask, False
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),  # (1, H, n, Hd)
            keys.transpose(0, 1).unsqueeze(0),  # (1, KV, ctx, Hd)
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=causal,
            scale=self.scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1).reshape(n, self.q_size)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up in one fused matmul."""

    def __init__(self, w: dict[str, torch.Tensor], quantization: str, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.hidden = w["gate"].shape[0]
        self.gate_up = make_linear(torch.cat([w["gate"], w["up"]]), None, quantization, dtype, device)
        self.down = make_linear(w["down"], None, quantization, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)  # (T, 2F)
        return self.down(F.silu(gate_up[:, : self.hidden]) * gate_up[:, self.hidden :])


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, w: dict[str, torch.Tensor], quantization: str, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(w["attn_norm"].to(device=device, dtype=dtype), config.rms_norm_eps)
        self.attn = Attention(config, w, quantization, dtype, device)
        self.ffn_norm = RMSNorm(w["ffn_norm"].to(device=device, dtype=dtype), config.rms_norm_eps)
        self.mlp = MLP(w, quantization, dtype, device)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), freqs, meta, k_cache, v_cache)
        return x + self.mlp(self.ffn_norm(x))


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm and LM head.

    ``weights`` uses the names of ``loader.py``; tensors already in the target
    dtype and device are shared, not copied.
    """

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype, quantization: str, device: torch.device, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        weights = dict(weights)  # the caller's dict stays intact (tests build several models)
        embed = weights.pop("embed")
        lm_head = weights.pop("lm_head", None)
        self.embed = nn.Parameter(embed.to(device=device, dtype=dtype), requires_grad=False)
        self.lm_head = make_linear(embed if lm_head is None else lm_head, None, quantization, dtype, device)
        if quantization == "none" and lm_head is None:
            self.lm_head.weight = self.embed  # tied: one copy in memory
        self.layers = nn.ModuleList()
        for i in range(config.num_layers):
            prefix = f"layers.{i}."
            layer_w = {k[len(prefix) :]: weights.pop(k) for k in [k for k in weights if k.startswith(prefix)]}
            self.layers.append(DecoderLayer(config, layer_w, quantization, dtype, device))
        self.norm = RMSNorm(weights.pop("norm").to(device=device, dtype=dtype), config.rms_norm_eps)
        self.register_buffer("rope", rope_frequencies(config, max_positions).to(device), persistent=False)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        logits_indices: torch.Tensor,  # (N,) rows of the flat batch that need next-token logits
    ) -> torch.Tensor:
        """Run the new tokens through the network; return float32 logits (N, vocab)."""
        x = F.embedding(input_ids, self.embed)  # (T, D)
        freqs = self.rope[positions].unsqueeze(1)  # (T, 1, Hd/2)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = layer(x, freqs, meta, k_cache, v_cache)
        x = self.norm(x[logits_indices])
        return self.lm_head(x).float()

    def layer_outputs(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """Hidden state after every layer (for quantization error tests)."""
        with torch.inference_mode():
            x = F.embedding(input_ids, self.embed)
            freqs = self.rope[positions].unsqueeze(1)
            outs = []
            for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
                x = layer(x, freqs, meta, k_cache, v_cache)
                outs.append(x.float())
            return outs
