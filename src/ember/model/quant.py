"""Linear layers: dense, int8 weight-only, int4 groups, and fbgemm's w8a8.

Numerics, chosen by ``EngineConfig.quantization``, and with the compiled CPU
kernels by ``EngineConfig.batch_invariant``:

* ``none``: ``y = x W^T`` in the activation dtype. Batch-invariant (float32
  with the kernels): a float32 copy of ``W`` in lanes of 8 outputs
  (``linear_f32_lanes``), one fixed reduction order per output whatever the
  number of rows.
* ``int8``: ``W ~ q * s`` with ``q`` int8 and one float scale per output
  channel. Batch-invariant (the default): W8A16 (``linear_w8a16``,
  kernels/linear_lanes.cpp): activations quantized per row to int16 in groups
  of 256, exact integer dot products (on AMX tiles from five rows on, or with
  AVX-512 VNNI from two, where the CPU has them: kernels/linear_amx.cpp and
  linear_lanes.cpp, the same bits), one fixed float epilogue; 1 byte per
  weight for every row count, no second copy. Otherwise (the previous path,
  ``batch_invariant=False``): float32 activations on the int8 weights up to 8
  rows, a bfloat16 copy (packed for AVX512-BF16 up to 64 rows, row-major
  beyond) for more rows; the fastest per shape on AVX-512, but a row's logits
  depend on how many rows share the step.
* ``int4``: 4-bit groups of 32 (``w ~ (q - 8) s + z``), torch's int4pack GEMV
  for decode rows; it reproduces a GGUF Q4_0/Q4_1 weight exactly.
* ``w8a8``: fbgemm's dynamic quantization (``quantized::linear_dynamic``),
  activations quantized per call; opt-in, less accurate (README, "Numerics").

Each module says how the compiled kernels run it through ``kernel_weights``
(a ``LinearWeights`` of kernels/cpu_kernels.cpp, or None when torch runs it),
and ``forward`` goes through the kernels' one dispatch rule (``linear``), the
same one the fused decode loop uses.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

# Without compiled kernels, torch's int8pack beats the bfloat16 GEMM up to 4 rows.
INT8_DIRECT_MAX_ROWS = 4
# Lanes of the batch-invariant kernels: outputs per vector (linear_lanes.cpp).
LANES = 8

QUANTIZATIONS = ("none", "int8", "int4", "w8a8")
INT4_GROUP = 32


@dataclass(frozen=True)
class Numerics:
    """How a model's linear layers are built: one value handed down instead of five arguments.

    ``kernels`` is the compiled CPU module (None: torch ops); ``batch_invariant``
    picks the kernels' lane layouts, whose results do not depend on the rows in a call.
    """

    quantization: str
    dtype: torch.dtype
    device: torch.device
    kernels: Any = None
    batch_invariant: bool = True


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, numerics: Numerics) -> KernelLinear:
    """A linear layer for ``weight`` (out, in) in the engine's numerics."""
    n = numerics
    lanes = n.kernels is not None and n.batch_invariant and weight.shape[0] % LANES == 0 and weight.shape[1] % 2 == 0
    if n.quantization == "int8":
        return Int8Linear(weight, bias, n, lanes)
    if n.quantization == "w8a8":
        return DynamicInt8Linear(weight, bias, n)
    if n.quantization == "int4":
        return Int4Linear(weight, bias, n)
    if n.quantization != "none":
        raise ValueError(f"unknown quantization {n.quantization!r}; expected one of {QUANTIZATIONS}")
    return DenseLinear(weight, bias, n, lanes and n.dtype == torch.float32)


_EMPTY = torch.empty(0)


def _kernel_weights(kernels: Any, kind: str, weight: torch.Tensor, input_dtype: torch.dtype, **parts: torch.Tensor | None) -> Any:
    """A ``LinearWeights`` for the kernels: absent parts become empty tensors."""
    given = {name: _EMPTY if parts.get(name) is None else parts[name] for name in ("scale", "dense", "packed", "bias")}
    return kernels.LinearWeights(kind=getattr(kernels.LinearKind, kind), weight=weight, input_bf16=input_dtype == torch.bfloat16, **given)


def pack_lanes(weight: torch.Tensor, pair: bool) -> torch.Tensor:
    """(N, K) -> lanes of 8 outputs: (N/8, K/2, 8, 2) when ``pair`` (int8 pairs for vpmaddwd), else (N/8, K, 8).

    The layouts of kernels/linear_lanes.cpp: one vector load gives every lane
    (output) its next input (pair).
    """
    n, k = weight.shape
    if pair:
        return weight.reshape(n // LANES, LANES, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    return weight.reshape(n // LANES, LANES, k).permute(0, 2, 1).contiguous()


class KernelLinear(nn.Module):
    """What the model needs of any linear layer.

    ``input_dtype``: the dtype its producer should emit (no cast needed);
    ``kernel_weights``: a kernels ``LinearWeights`` when the compiled kernels
    run it (the fused decode loop needs one per linear), else None.
    """

    input_dtype: torch.dtype
    kernel_weights: Any
    kernels: Any


class DenseLinear(KernelLinear):
    """``y = x W^T + b`` in ``dtype``; with ``lanes``, only a float32 lane copy of ``W`` is kept (batch-invariant)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, numerics: Numerics, lanes: bool) -> None:
        super().__init__()
        dtype, device, kernels = numerics.dtype, numerics.device, numerics.kernels
        dense = weight.to(device=device, dtype=dtype).contiguous()
        self.weight: nn.Parameter | None = None if lanes else nn.Parameter(dense, requires_grad=False)
        self.lanes: torch.Tensor | None
        self.register_buffer("lanes", pack_lanes(dense, pair=False) if lanes else None)
        self.bias: nn.Parameter | None = None if bias is None else nn.Parameter(bias.to(device=device, dtype=dtype), requires_grad=False)
        self.input_dtype = dtype
        self.kernels = kernels
        self.kernel_weights = self._build_kernel_weights()

    def _build_kernel_weights(self) -> Any:
        if self.kernels is None:
            return None
        bias = None if self.bias is None else self.bias.detach().float()
        if self.lanes is not None:
            return _kernel_weights(self.kernels, "DENSE_LANES", self.lanes, self.input_dtype, bias=bias)
        assert self.weight is not None
        return _kernel_weights(self.kernels, "DENSE", self.weight.detach(), self.input_dtype, bias=bias)

    def share_weight(self, weight: nn.Parameter) -> None:
        """Use ``weight`` (the same values, e.g. a tied embedding) instead of a row-major copy of it."""
        if self.lanes is None:
            self.weight = weight
            self.kernel_weights = self._build_kernel_weights()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel_weights is not None:
            return self.kernels.linear(x, self.kernel_weights)
        assert self.weight is not None
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


class Int8Linear(KernelLinear):
    """Weight-only int8 with per-output-channel scales; see the module docstring.

    With the kernels and ``lanes``: the int8 weights in lanes, nothing else
    (W8A16, batch-invariant). With the kernels otherwise: the int8 weights
    row-major for the GEMV, a bfloat16 dense copy and, where the CPU has
    AVX512-BF16, a packed bfloat16 copy (all the same values, the int8 weights
    times their scales rounded to bfloat16). Without kernels: torch's int8pack
    for a few rows, the dense copy beyond. ``input_dtype`` tells producers
    which dtype to emit so no cast is needed.
    """

    qweight: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None
    dense: torch.Tensor | None
    scale_compute: torch.Tensor | None
    packed: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, numerics: Numerics, lanes: bool) -> None:
        super().__init__()
        dtype, device, kernels = numerics.dtype, numerics.device, numerics.kernels
        q, scale = quantize_per_channel_int8(weight)
        self.kernels = kernels if device.type == "cpu" else None
        self.direct = device.type == "cpu"
        self.compute_dtype = torch.bfloat16 if self.direct else dtype
        self.register_buffer("scale", scale.to(device=device, dtype=torch.float32))
        self.register_buffer("bias", None if bias is None else bias.to(device=device, dtype=torch.float32))
        self.input_dtype = torch.float32 if self.kernels is not None else self.compute_dtype
        lanes = lanes and self.kernels is not None
        self.register_buffer("qweight", pack_lanes(q, pair=True).to(device) if lanes else q.to(device))
        self.register_buffer("dense", None if lanes else (q.float() * scale[:, None]).to(device=device, dtype=self.compute_dtype))
        self.register_buffer("scale_compute", None if lanes else scale.to(device=device, dtype=self.compute_dtype))
        out_f, in_f = weight.shape
        packable = not lanes and self.kernels is not None and int(self.kernels.packed_max_rows) > 0 and out_f % 16 == 0 and in_f % 2 == 0
        self.register_buffer("packed", pack_bf16_for_kernels(self.dense) if packable and self.dense is not None else None)
        self.kernel_weights: Any = None
        if self.kernels is not None:
            kind = "INT8_LANES" if lanes else "INT8_ROWS"
            self.kernel_weights = _kernel_weights(
                self.kernels, kind, self.qweight, self.input_dtype, scale=self.scale, dense=self.dense, packed=self.packed, bias=self.bias
            )

    @property
    def has_lanes(self) -> bool:
        return self.dense is None

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Weight rows ``ids`` (outputs), dequantized to float32: (len(ids), in).

        A tied embedding table is the LM head's weight: looking tokens up here
        keeps one int8 copy of it instead of a float32 table beside it.
        """
        if self.has_lanes:  # lanes exist only with the kernels: one call, the same bits as q * scale
            return cast(torch.Tensor, self.kernels.lanes_rows(self.qweight, self.scale, ids))
        q = self.qweight[ids]
        return q.float() * self.scale[ids, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel_weights is not None:
            return self.kernels.linear(x, self.kernel_weights)
        assert self.dense is not None and self.scale_compute is not None  # lanes exist only with the kernels
        if self.direct and x.shape[0] <= INT8_DIRECT_MAX_ROWS:
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


class Int4Linear(KernelLinear):
    """Weight-only 4-bit groups (torch's int4pack GEMV on CPU) for the memory-bound
    decode rows, a dense bfloat16 copy of the same values for many rows."""

    packed: torch.Tensor
    scale_zero: torch.Tensor
    dense: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, numerics: Numerics) -> None:
        super().__init__()
        device, kernels = numerics.device, numerics.kernels
        if device.type != "cpu" or weight.shape[1] % INT4_GROUP:
            raise ValueError("quantization='int4' needs a CPU and input sizes divisible by 32")
        q, scale, zero = quantize_groups_int4(weight)
        self.input_dtype = torch.bfloat16
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(q, 2))
        self.register_buffer("scale_zero", torch.stack([scale, zero], -1).to(torch.bfloat16))
        dense = (q.float() - 8) * scale.t().repeat_interleave(INT4_GROUP, 1) + zero.t().repeat_interleave(INT4_GROUP, 1)
        self.register_buffer("dense", dense.to(torch.bfloat16))
        self.register_buffer("bias", None if bias is None else bias.to(device=device, dtype=torch.bfloat16))
        self.kernels = kernels
        self.kernel_weights: Any = None
        if kernels is not None:
            self.kernel_weights = _kernel_weights(
                kernels, "INT4", self.packed, self.input_dtype, scale=self.scale_zero, dense=self.dense, bias=self.bias
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel_weights is not None:
            return self.kernels.linear(x, self.kernel_weights)
        xc = x.to(torch.bfloat16)
        if x.shape[0] <= INT8_DIRECT_MAX_ROWS:
            y = torch._weight_int4pack_mm_for_cpu(xc, self.packed, INT4_GROUP, self.scale_zero)
        else:
            y = nn.functional.linear(xc, self.dense)
        return y if self.bias is None else y + self.bias


@functools.lru_cache(maxsize=1)
def _cpu_has_vnni() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_vnni" in flags or "avx_vnni" in flags


class DynamicInt8Linear(KernelLinear):
    """int8 weights and per-call dynamically quantized int8 activations (fbgemm, CPU only)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, numerics: Numerics) -> None:
        super().__init__()
        dtype, device = numerics.dtype, numerics.device
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
        self.kernel_weights = None  # fbgemm runs it: the fused decode loop has no twin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.quantized.linear_dynamic(x.to(torch.float32), self._packed, self._reduce_range)
        return y if self.dtype == torch.float32 else y.to(self.dtype)
