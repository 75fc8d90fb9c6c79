"""Linear layers: dense, int8 weight-only, and int8 weights with int8 activations.

Three numerics, chosen by ``EngineConfig.quantization``:

* ``none``: ``y = x W^T`` in the activation dtype.
* ``int8`` (weight-only): ``W ~ q * s`` with ``q`` int8 and one float scale
  per output channel; activations stay in the activation dtype. A matmul of a
  few rows (decode) is memory-bound, so it reads the int8 weight directly
  (``torch._weight_int8pack_mm``: half the bytes of bf16). Many rows (prefill,
  large decode batches) are compute-bound; they use a dense copy of the
  dequantized weight, which runs on the fast GEMM. Both paths compute with the
  same dequantized weight values.
* ``w8a8``: fbgemm's dynamic quantization (``quantized::linear_dynamic``): the
  activation is also quantized to int8, per call, and the product runs on int8
  units. Fastest at every batch size on AVX-512 VNNI, but activation outliers
  make it clearly less accurate (README, "Numerics"); opt-in.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

# Rows at or below which the int8 weight-only path reads int8 weights directly.
# Measured on the 2-core AVX-512 machine: int8pack wins up to 4 rows, the dense
# bf16 GEMM from 8 rows on (README, "Numerics").
INT8_DIRECT_MAX_ROWS = 4

QUANTIZATIONS = ("none", "int8", "w8a8")


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, quantization: str, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """A linear layer for ``weight`` (out, in) in the engine's numerics."""
    if quantization == "int8":
        return Int8Linear(weight, bias, dtype, device)
    if quantization == "w8a8":
        return DynamicInt8Linear(weight, bias, dtype, device)
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


class Int8Linear(nn.Module):
    """Weight-only int8 with per-output-channel scales; see the module docstring.

    On CPU the product runs in bfloat16 whatever the activation dtype, because
    both fast kernels, int8pack and the oneDNN GEMM, are bfloat16 kernels: the
    input is cast at the boundary (``input_dtype`` tells producers which dtype
    to emit so the cast is free) and the output is returned in bfloat16; the
    float32 residual stream absorbs it.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        q, scale = quantize_per_channel_int8(weight)
        self.dtype = dtype
        self.compute_dtype = torch.bfloat16 if device.type == "cpu" else dtype
        self.register_buffer("qweight", q.to(device))
        self.register_buffer("scale", scale.to(device=device, dtype=self.compute_dtype))
        self.register_buffer("dense", (q.float() * scale[:, None]).to(device=device, dtype=self.compute_dtype))
        self.register_buffer("bias", None if bias is None else bias.to(device=device, dtype=self.compute_dtype))
        self.direct = device.type == "cpu"
        self.input_dtype = self.compute_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xc = x.to(self.compute_dtype)
        if self.direct and x.shape[0] <= INT8_DIRECT_MAX_ROWS:
            y = torch._weight_int8pack_mm(xc, self.qweight, self.scale)
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
