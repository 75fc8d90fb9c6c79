"""Linear layers: dense, int8 weight-only, and int8 weights with int8 activations.

Three numerics, chosen by ``EngineConfig.quantization``:

* ``none``: ``y = x W^T`` in the activation dtype.
* ``int8`` (weight-only): ``W ~ q * s`` with ``q`` int8 and one float scale
  per output channel. A matmul of a few rows (decode) is memory-bound, so it
  reads the int8 weight directly (a quarter of float32's bytes). Many rows
  (prefill, large decode batches) are compute-bound; they use a bfloat16 dense
  copy of the dequantized weight on the fast GEMM. Both paths compute with the
  same dequantized weight values.
* ``int4``: 4-bit groups of 32 (``w ~ (q - 8) s + z``), torch's int4pack GEMV
  for decode rows; it reproduces a GGUF Q4_0/Q4_1 weight exactly.
* ``w8a8``: fbgemm's dynamic quantization (``quantized::linear_dynamic``): the
  activation is also quantized to int8, per call, and the product runs on int8
  units. Fastest at every batch size on AVX-512 VNNI, but activation outliers
  make it clearly less accurate (README, "Numerics"); opt-in.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ember.kernels import cpu as cpu_kernels

# Rows at or below which the int8 weight-only path reads int8 weights directly
# (Ember's float32 GEMV; measured faster than any bf16 GEMM up to 8 rows on the
# 2-core AVX-512 machine). From there up to the kernels' ``packed_max_rows``
# (64 where they were built with AVX512-BF16, else 0) a bfloat16 copy packed
# for vdpbf16ps is used: all 30 layers' linears at 16 rows take 15.8 ms that
# way against 24.2 ms for oneDNN's bf16 GEMM on the row-major copy. torch's
# int8pack (no compiled kernels) beats the GEMM up to 4 rows.
GEMV_MAX_ROWS = 8
INT8_DIRECT_MAX_ROWS = 4

QUANTIZATIONS = ("none", "int8", "int4", "w8a8")
INT4_GROUP = 32


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, quantization: str, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """A linear layer for ``weight`` (out, in) in the engine's numerics."""
    if quantization == "int8":
        return Int8Linear(weight, bias, dtype, device)
    if quantization == "w8a8":
        return DynamicInt8Linear(weight, bias, dtype, device)
    if quantization == "int4":
        return Int4Linear(weight, bias, dtype, device)
    if quantization != "none":
        raise ValueError(f"unknown quantization {quantization!r}; expected one of {QUANTIZATIONS}")
    return DenseLinear(weight, bias, dtype, device)


class DenseLinear(nn.Module):
    """``y = x W^T + b`` in ``dtype``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.to(device=device, dtype=dtype).contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.to(device=device, dtype=dtype), requires_grad=False)
        self.input_dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x.to(self.input_dtype), self.weight, self.bias)


def quantize_per_channel_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization with one float32 scale per output row.

    Invariant: ``|q| <= 127`` and ``q * scale[:, None]`` is the nearest grid
    point to ``weight`` on each row's grid.
    """
    w = weight.to(torch.float32)
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def pack_bf16_for_kernels(dense: torch.Tensor) -> torch.Tensor:
    """(N, K) bfloat16 -> (N / 16, K / 2, 16, 2): per input pair, that pair for 16 outputs side by side.

    The layout of ``gemm_bf16_packed`` (kernels/cpu_kernels.cpp): one vector
    load gives vdpbf16ps an input pair for 16 outputs.
    """
    n, k = dense.shape
    return dense.reshape(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


class Int8Linear(nn.Module):
    """Weight-only int8 with per-output-channel scales; see the module docstring.

    On CPU up to 8 rows (decode) go through Ember's int8 GEMV kernel
    (kernels/cpu_kernels.cpp: float32 activations, ~31 GB/s of weights) or,
    without it, torch's int8pack; 9 to 64 rows (batched decode) through Ember's
    bfloat16 kernel on a packed copy where the CPU has AVX512-BF16; more rows
    (prefill) through the bfloat16 GEMM on a dense copy. Both copies hold the
    same values, the int8 weights times their scales rounded to bfloat16.
    ``input_dtype`` tells producers which dtype to emit so no cast is needed.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        q, scale = quantize_per_channel_int8(weight)
        self.kernels = cpu_kernels.load() if device.type == "cpu" else None
        self.direct = device.type == "cpu"
        self.compute_dtype = torch.bfloat16 if self.direct else dtype
        self.register_buffer("qweight", q.to(device))
        self.register_buffer("scale", scale.to(device=device, dtype=torch.float32))
        self.register_buffer("scale_compute", scale.to(device=device, dtype=self.compute_dtype))
        self.register_buffer("dense", (q.float() * scale[:, None]).to(device=device, dtype=self.compute_dtype))
        out_f, in_f = weight.shape
        packable = self.kernels is not None and self.compute_dtype == torch.bfloat16 and out_f % 16 == 0 and in_f % 2 == 0
        self.packed_max_rows = int(getattr(self.kernels, "packed_max_rows", 0)) if packable else 0
        self.register_buffer("packed", pack_bf16_for_kernels(self.dense) if self.packed_max_rows else None)
        self.register_buffer("bias", None if bias is None else bias.to(device=device, dtype=torch.float32))
        self.input_dtype = torch.float32 if self.kernels is not None else self.compute_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.kernels is not None and rows <= GEMV_MAX_ROWS:
            y = self.kernels.gemv_int8(x, self.qweight, self.scale)
        elif rows <= self.packed_max_rows:
            y = self.kernels.gemm_bf16_packed(x, self.packed)
        elif self.direct and rows <= INT8_DIRECT_MAX_ROWS:
            y = torch._weight_int8pack_mm(x.to(self.compute_dtype), self.qweight, self.scale_compute)
        else:
            y = nn.functional.linear(x.to(self.compute_dtype), self.dense)
        return y if self.bias is None else y + self.bias


def quantize_groups_int4(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit quantization in groups of ``group`` inputs: ``w ~ (q - 8) * s + z``.

    Returns ``q`` (out, in) int32 in [0, 15] and ``s``, ``z`` (in / group, out).
    A GGUF Q4_1 group (``w = d * q + m``) whose codes span 0..15 comes back
    exactly: ``s = d`` and ``z = m + 8 d``.
    """
    out_f, in_f = weight.shape
    w = weight.to(torch.float32).reshape(out_f, in_f // group, group)
    lo, hi = w.amin(-1), w.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-12)
    q = torch.round((w - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.int32).reshape(out_f, in_f)
    zero = lo + 8 * scale
    return q, scale.t().contiguous(), zero.t().contiguous()


class Int4Linear(nn.Module):
    """Weight-only 4-bit groups (torch's int4pack GEMV on CPU) for the memory-bound
    decode rows, a dense bfloat16 copy of the same values for many rows."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        if device.type != "cpu" or weight.shape[1] % INT4_GROUP:
            raise ValueError("quantization='int4' needs a CPU and input sizes divisible by 32")
        q, scale, zero = quantize_groups_int4(weight)
        self.input_dtype = torch.bfloat16
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(q, 2))
        self.register_buffer("scale_zero", torch.stack([scale, zero], -1).to(torch.bfloat16))
        dense = (q.float() - 8) * scale.t().repeat_interleave(INT4_GROUP, 1) + zero.t().repeat_interleave(INT4_GROUP, 1)
        self.register_buffer("dense", dense.to(torch.bfloat16))
        self.register_buffer("bias", None if bias is None else bias.to(device=device, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xc = x.to(torch.bfloat16)
        if x.shape[0] <= INT8_DIRECT_MAX_ROWS:
            y = torch._weight_int4pack_mm_for_cpu(xc, self.packed, INT4_GROUP, self.scale_zero)
        else:
            y = nn.functional.linear(xc, self.dense)
        return y if self.bias is None else y + self.bias


def linear_parts(layer: nn.Module) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(kind, quantized weight, scales, dense copy, packed bf16 copy) as the C++ decode loop takes them; None if it has no twin.

    Kinds: 0 dense, 1 int8 weight-only, 2 int4 groups (see kernels/cpu_kernels.cpp).
    """
    empty = torch.empty(0)
    if isinstance(layer, DenseLinear):
        return 0, layer.weight, empty, empty, empty
    if isinstance(layer, Int8Linear) and layer.kernels is not None:
        return 1, layer.qweight, layer.scale, layer.dense, empty if layer.packed is None else layer.packed
    if isinstance(layer, Int4Linear):
        return 2, layer.packed, layer.scale_zero, layer.dense, empty
    return None


@functools.lru_cache(maxsize=1)
def _cpu_has_vnni() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_vnni" in flags or "avx_vnni" in flags


class DynamicInt8Linear(nn.Module):
    """int8 weights and per-call dynamically quantized int8 activations (fbgemm, CPU only)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        if device.type != "cpu" or "fbgemm" not in torch.backends.quantized.supported_engines:
            raise ValueError("quantization='w8a8' needs a CPU with fbgemm; use 'int8' elsewhere")
        q, scale = quantize_per_channel_int8(weight)
        self.dtype = dtype
        fp32_bias = None if bias is None else bias.to(torch.float32)
        qw = torch._make_per_channel_quantized_tensor(q, scale.to(torch.float64), torch.zeros(q.shape[0], dtype=torch.int64), 0)
        self._packed = torch.ops.quantized.linear_prepack(qw, fp32_bias)
        # Without VNNI, fbgemm's u8*s8 pairs can saturate int16; reduce_range avoids it.
        self._reduce_range = not _cpu_has_vnni()
        self.input_dtype = torch.float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.quantized.linear_dynamic(x.to(torch.float32), self._packed, self._reduce_range)
        return y if self.dtype == torch.float32 else y.to(self.dtype)
