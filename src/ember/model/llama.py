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
from dataclasses import dataclass, field, replace
from typing import Any, cast

import torch
from torch import nn
from torch.nn import functional as F

from ember.config import ModelConfig
from ember.kernels import cpu as cpu_kernels
from ember.model.kv_values import as_kv_values
from ember.model.quant import DenseLinear, Int8Linear, KernelLinear, Numerics, make_linear


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
    positions: torch.Tensor | None = None  # (T,) position of each new token
    num_decode_tokens: int = 0
    # Decode attention inputs: padded slot lists and mask for the torch path,
    # block tables and context lengths for the fused kernel (only one is built).
    decode_slots: torch.Tensor | None = None  # (B, L)
    decode_mask: torch.Tensor | None = None  # (B, 1, 1, L) bool
    decode_block_tables: torch.Tensor | None = None  # (B, max_blocks)
    decode_context_lens: torch.Tensor | None = None  # (B,)
    block_size: int = 16
    prefills: list[PrefillSegment] = field(default_factory=list)
    # One paged attention call for every new token (the batch-invariant kernel
    # path): block tables of the step's sequences, then per token the row of
    # its sequence (None when token i is on row i: a decode-only step) and its
    # context length (position + 1).
    block_tables: torch.Tensor | None = None  # (S, max_blocks)
    token_table_rows: torch.Tensor | None = None  # (T,)
    token_context_lens: torch.Tensor | None = None  # (T,)
    # Rotations for the new tokens (torch path), filled by the model.
    rope_freqs: torch.Tensor | None = None  # (T, 1, Hd/2) complex


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
    def __init__(self, weight: torch.Tensor, eps: float, kernels: Any = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
        """``x += delta`` in place (the residual connection), then the norm of ``x`` in ``out_dtype``."""
        if self.kernels is not None:
            out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
            if delta is None:
                self.kernels.rmsnorm(out, x, self.weight, self.eps)
            else:
                self.kernels.add_rmsnorm(out, x, delta.contiguous(), self.weight, self.eps)
            return out
        if delta is not None:
            x.add_(delta)
        return self.forward(x).to(out_dtype)


class Attention(nn.Module):
    """Grouped-query attention over the paged KV cache; q/k/v in one fused matmul."""

    qkv: KernelLinear
    o: KernelLinear
    qkv_bias: torch.Tensor | None
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, config: ModelConfig, w: dict[str, torch.Tensor], numerics: Numerics) -> None:
        super().__init__()
        dtype, device, kernels = numerics.dtype, numerics.device, numerics.kernels
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = 1.0 / math.sqrt(config.head_dim)
        self.kernels = kernels
        self.qkv = make_linear(torch.cat([w["q"], w["k"], w["v"]]), None, numerics)
        # Kept apart from the matmul: the fused rotary kernel adds it on the fly.
        bias = torch.cat([w["q_bias"], w["k_bias"], w["v_bias"]]) if config.attention_bias else None
        self.register_buffer("qkv_bias", None if bias is None else bias.to(device=device, dtype=torch.float32))
        self.o = make_linear(w["o"], w.get("o_bias"), numerics)
        # Attention runs in the model dtype whatever the cache holds: a float16 cache
        # (EngineConfig.kv_cache_dtype) is read as float32, as the kernels read it.
        # Measured: torch's CPU flash attention is slower in bfloat16 (398 ms for a
        # 1,000-token prompt) than in float32 (338 ms).
        self.attention_dtype = dtype

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv(x)  # (T, q + 2 kv)
        out = torch.empty(t, self.q_size, dtype=self.o.input_dtype, device=x.device)  # (T, H * Hd)
        if self.kernels is not None:
            # Rotates q and k, writes k and v into the cache: one call.
            q = self.kernels.rope_store(
                qkv.contiguous(),
                self.rope_cos,
                self.rope_sin,
                meta.positions,
                meta.slot_mapping,
                k_cache,
                v_cache,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                self.qkv_bias,
            )
        else:
            q = self._rope_store(qkv, meta, k_cache, v_cache)
        if meta.token_context_lens is not None:  # every token in one call: decode and prompt rows alike
            self.kernels.paged_attention(
                out, q, k_cache, v_cache, meta.block_tables, meta.token_table_rows, meta.token_context_lens, meta.block_size, self.scale
            )
            return self.o(out)
        nd = meta.num_decode_tokens
        if nd:
            if self.kernels is not None:
                self.kernels.paged_attention(
                    out[:nd],
                    q[:nd],
                    k_cache,
                    v_cache,
                    meta.decode_block_tables,
                    None,
                    meta.decode_context_lens,
                    meta.block_size,
                    self.scale,
                )
            else:
                out[:nd] = self._decode(q[:nd], meta, k_cache, v_cache)
        for seg in meta.prefills:
            out[seg.start : seg.end] = self._prefill(q[seg.start : seg.end], seg, meta, k_cache, v_cache)
        return self.o(out)  # (T, D)

    def _rope_store(self, qkv: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """The torch path of ``rope_store``: rotate q and k, write k and v to the cache, return q."""
        t = qkv.shape[0]
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        assert meta.rope_freqs is not None
        heads = qkv[:, : self.q_size + self.kv_size].reshape(t, self.num_heads + self.num_kv_heads, self.head_dim)
        qk = apply_rope(heads, meta.rope_freqs)
        v = qkv[:, self.q_size + self.kv_size :].reshape(t, self.num_kv_heads, self.head_dim)
        k_cache.index_copy_(0, meta.slot_mapping, as_kv_values(qk[:, self.num_heads :], k_cache.dtype))
        v_cache.index_copy_(0, meta.slot_mapping, as_kv_values(v, v_cache.dtype))
        return qk[:, : self.num_heads]  # (T, H, Hd)

    def _decode(self, q: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        b = q.shape[0]
        dtype = self.attention_dtype
        keys = k_cache[meta.decode_slots].transpose(1, 2).to(dtype)  # (B, KV, L, Hd)
        values = v_cache[meta.decode_slots].transpose(1, 2).to(dtype)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2).to(dtype), keys, values, attn_mask=meta.decode_mask, scale=self.scale, enable_gqa=True
        )  # (B, H, 1, Hd)
        return out.reshape(b, self.q_size)

    def _prefill(
        self, q: torch.Tensor, seg: PrefillSegment, meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        """Causal attention of a prompt chunk over its whole context, read back from the cache."""
        n = q.shape[0]
        if seg.context_slots is None:  # the chunk is the whole context: plain causal attention
            slots, mask, causal = meta.slot_mapping[seg.start : seg.end], None, True
        else:
            slots, mask, causal = seg.context_slots, seg.mask, False
        dtype = self.attention_dtype
        keys, values = k_cache[slots].to(dtype), v_cache[slots].to(dtype)  # (ctx, KV, Hd)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0).to(dtype),  # (1, H, n, Hd)
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

    gate_up: KernelLinear
    down: KernelLinear

    def __init__(self, w: dict[str, torch.Tensor], numerics: Numerics) -> None:
        super().__init__()
        self.hidden = w["gate"].shape[0]
        self.kernels = numerics.kernels
        self.gate_up = make_linear(torch.cat([w["gate"], w["up"]]), None, numerics)
        self.down = make_linear(w["down"], None, numerics)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and self.gate_up.kernel_weights is not None:
            act = self.kernels.swiglu(x, self.gate_up.kernel_weights, self.down.input_dtype)
        else:
            gate_up = self.gate_up(x)  # (T, 2F)
            act = (F.silu(gate_up[:, : self.hidden]) * gate_up[:, self.hidden :]).to(self.down.input_dtype)
        return self.down(act)


class DecoderLayer(nn.Module):
    """Pre-norm block. The residual additions are deferred into the next norm
    (``add_norm``) so that each addition and normalisation is one pass."""

    attn_norm: RMSNorm
    attn: Attention
    ffn_norm: RMSNorm
    mlp: MLP

    def __init__(self, config: ModelConfig, w: dict[str, torch.Tensor], numerics: Numerics) -> None:
        super().__init__()
        dtype, device, kernels = numerics.dtype, numerics.device, numerics.kernels
        self.attn_norm = RMSNorm(w["attn_norm"].to(device=device, dtype=dtype), config.rms_norm_eps, kernels)
        self.attn = Attention(config, w, numerics)
        self.ffn_norm = RMSNorm(w["ffn_norm"].to(device=device, dtype=dtype), config.rms_norm_eps, kernels)
        self.mlp = MLP(w, numerics)

    def forward(
        self, x: torch.Tensor, delta: torch.Tensor | None, meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        """Adds ``delta`` (the previous block's output) to the residual ``x`` in
        place and returns this block's MLP output, still to be added."""
        h = self.attn_norm.add_norm(x, delta, self.attn.qkv.input_dtype)
        attn_out = self.attn(h, meta, k_cache, v_cache)
        h = self.ffn_norm.add_norm(x, attn_out, self.mlp.gate_up.input_dtype)
        return self.mlp(h)


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm and LM head.

    ``weights`` uses the names of ``loader.py``; tensors already in the target
    dtype and device are shared, not copied.
    """

    lm_head: KernelLinear
    norm: RMSNorm
    rope: torch.Tensor
    kernels: Any

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        quantization: str,
        device: torch.device,
        max_positions: int,
        use_kernels: bool = True,
        batch_invariant: bool = True,
    ) -> None:
        super().__init__()
        # The fused CPU kernels assume a float32 residual stream and KV cache.
        kernels = cpu_kernels.load() if use_kernels and device.type == "cpu" and dtype == torch.float32 else None
        self.kernels = kernels
        # Batch invariance needs the kernels (their lane linears and the paged
        # attention for prompt rows too); torch's own ops do not promise it, and
        # int4 and w8a8 have no lane kernels.
        self.batch_invariant = batch_invariant and kernels is not None and quantization in ("none", "int8")
        self.config = config
        self.dtype = dtype
        weights = dict(weights)  # the caller's dict stays intact (tests build several models)
        embed = weights.pop("embed")
        lm_head = weights.pop("lm_head", None)
        # The output layer decides every token: it never goes below 8 bits.
        head_quantization = "int8" if quantization == "int4" else quantization
        numerics = Numerics(quantization, dtype, device, kernels, self.batch_invariant)
        self.lm_head = make_linear(embed if lm_head is None else lm_head, None, replace(numerics, quantization=head_quantization))
        # Tied and batch-invariant int8: tokens are looked up in the LM head's
        # int8 rows (113 MB of float32 table saved on SmolLM2-135M).
        self.embed_from_head = lm_head is None and isinstance(self.lm_head, Int8Linear) and self.lm_head.has_lanes
        self.embed: nn.Parameter | None = None
        if not self.embed_from_head:
            self.embed = nn.Parameter(embed.to(device=device, dtype=dtype), requires_grad=False)
        if isinstance(self.lm_head, DenseLinear) and lm_head is None and self.embed is not None and dtype == self.embed.dtype:
            self.lm_head.share_weight(self.embed)  # tied: one copy in memory (unless it runs from lanes)
        self.layers = nn.ModuleList()
        for i in range(config.num_layers):
            prefix = f"layers.{i}."
            layer_w = {k[len(prefix) :]: weights.pop(k) for k in [k for k in weights if k.startswith(prefix)]}
            self.layers.append(DecoderLayer(config, layer_w, numerics))
        self.norm = RMSNorm(weights.pop("norm").to(device=device, dtype=dtype), config.rms_norm_eps, kernels)
        self.register_buffer("rope", rope_frequencies(config, max_positions).to(device), persistent=False)
        self.rope_cos, self.rope_sin = self.rope.real.contiguous(), self.rope.imag.contiguous()  # (max_pos, Hd/2) float32
        for layer in self.decoder_layers:
            layer.attn.rope_cos, layer.attn.rope_sin = self.rope_cos, self.rope_sin
        self._decode_plan = self._build_decode_plan() if kernels is not None else None

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        """``layers``, typed."""
        return cast(list[DecoderLayer], list(self.layers))

    def _build_decode_plan(self) -> list[Any] | None:
        """Each layer's weights as ``decode_layers`` takes them (kernels/cpu_kernels.cpp ``LayerWeights``); None if a linear has no C++ twin."""
        plan = []
        for layer in self.decoder_layers:
            attn, mlp = layer.attn, layer.mlp
            linears = [attn.qkv.kernel_weights, attn.o.kernel_weights, mlp.gate_up.kernel_weights, mlp.down.kernel_weights]
            if any(w is None for w in linears):
                return None
            qkv, o, gate_up, down = linears
            plan.append(
                self.kernels.LayerWeights(
                    attn_norm=layer.attn_norm.weight,
                    qkv=qkv,
                    qkv_bias=torch.empty(0) if attn.qkv_bias is None else attn.qkv_bias,
                    o=o,
                    ffn_norm=layer.ffn_norm.weight,
                    gate_up=gate_up,
                    down=down,
                )
            )
        return plan

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
        x = self._residual_stream(input_ids, positions, meta, kv_caches)
        x = self.norm.add_norm(x[logits_indices], None, self.lm_head.input_dtype)
        return self.lm_head(x).float()

    def _residual_stream(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        per_layer: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        # (T, D), a fresh tensor: updated in place below
        x = cast(Int8Linear, self.lm_head).rows(input_ids).to(self.dtype) if self.embed is None else F.embedding(input_ids, self.embed)
        meta.positions = positions
        unified = meta.token_context_lens is not None
        if self._decode_plan is not None and (unified or not meta.prefills) and per_layer is None:
            # The whole stack in one compiled call, no Python per layer: a decode-only step
            # (drafts included), or any step whose tokens attend in one call (prompt rows too).
            c = self.config
            return self.kernels.decode_layers(
                x,
                self._decode_plan,
                [k for k, _ in kv_caches],
                [v for _, v in kv_caches],
                self.rope_cos,
                self.rope_sin,
                positions,
                meta.slot_mapping,
                meta.block_tables if unified else meta.decode_block_tables,
                meta.token_table_rows if unified else None,
                meta.token_context_lens if unified else meta.decode_context_lens,
                c.num_heads,
                c.num_kv_heads,
                c.head_dim,
                meta.block_size,
                c.rms_norm_eps,
            )
        if self.kernels is None:
            meta.rope_freqs = self.rope[positions].unsqueeze(1)  # (T, 1, Hd/2)
        delta = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            delta = layer(x, delta, meta, k_cache, v_cache)
            if per_layer is not None:
                per_layer.append((x + delta).float())
        return x + delta if delta is not None else x

    def layer_outputs(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> list[torch.Tensor]:
        """Hidden state after every layer (for quantization error tests)."""
        outs: list[torch.Tensor] = []
        with torch.inference_mode():
            self._residual_stream(input_ids, positions, meta, kv_caches, per_layer=outs)
        return outs
