"""Linear layers: dense, and int8 weights with one scale per output channel.

``Int8Linear`` stores ``round(W / s)`` as int8 with ``s = max|W_row| / 127``.
How it multiplies depends on the device:

* CPU: fbgemm's dynamic-quantized GEMM (``quantized::linear_dynamic``). The
  activation is quantized to 8 bits on the fly and the product runs on int8
  units (AVX-512 VNNI where present). Measured on this project's 2-core AVX-512
  machine it beats bf16 and fp32 at every batch size, single-token decode
  included (README, "Numerics"). The activation scale is per call, so a row's
  result depends slightly on the other rows of the same call: int8 mode is not
  bit-for-bit batch-invariant (float32 and bfloat16 are).
* Elsewhere (CUDA, ...): weight-only; the weight is dequantized to the
  activation dtype inside the call.
"""

from __future__ import annotations

import functools

import torch
from torch import nn


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, quantization: str, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """A linear layer for ``weight`` (out, in) in the engine's numerics."""
    if quantization == "int8":
        return Int8Linear(weight, bias, dtype, device)
    if quantization != "none":
        raise ValueError(f"unknown quantization {quantization!r}; expected 'none' or 'int8'")
    return DenseLinear(weight, bias, dtype, device)


class DenseLinear(nn.Module):
    """``y = x W^T + b`` in ``dtype``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.to(device=device, dtype=dtype).contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.to(device=device, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


def quantize_per_channel_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization with one float32 scale per output row.

    Invariant: ``|q| <= 127`` and ``q * scale[:, None]`` is the nearest grid
    point to ``weight`` on each row's grid.
    """
    w = weight.to(torch.float32)
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


@functools.lru_cache(maxsize=1)
def _cpu_has_vnni() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_vnni" in flags or "avx_vnni" in flags


class Int8Linear(nn.Module):
    """Per-output-channel int8 weights; see the module docstring for the kernels."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        q, scale = quantize_per_channel_int8(weight)
        self.out_features, self.in_features = q.shape
        self.dtype = dtype
        self.use_fbgemm = device.type == "cpu" and "fbgemm" in torch.backends.quantized.supported_engines
        self.register_buffer("qweight", q.to(device))
        self.register_buffer("scale", scale.to(device))
        self.register_buffer("bias", None if bias is None else bias.to(device=device, dtype=torch.float32))
        if self.use_fbgemm:
            qw = torch._make_per_channel_quantized_tensor(q, scale.to(torch.float64), torch.zeros_like(scale, dtype=torch.int64), 0)
            self._packed = torch.ops.quantized.linear_prepack(qw, self.bias)
            # Without VNNI, fbgemm's u8*s8 pairs can saturate int16; reduce_range avoids it.
            self._reduce_range = not _cpu_has_vnni()

    @property
    def weight_bytes(self) -> int:
        return self.qweight.numel() + self.scale.numel() * 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_fbgemm:
            y = torch.ops.quantized.linear_dynamic(x.to(torch.float32), self._packed, self._reduce_range)
            return y if self.dtype == torch.float32 else y.to(self.dtype)
        w = self.qweight.to(x.dtype) * self.scale.to(x.dtype)[:, None]
        return nn.functional.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))
