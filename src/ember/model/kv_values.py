"""How values enter a KV cache: rounded to the cache's dtype, and saturated in float16.

A float16 cache (``EngineConfig.kv_cache_dtype="float16"``) holds up to
±65,504. A plain conversion turns anything beyond into infinity, and one
infinite key makes its sequence's attention NaN from then on. Saturating
instead keeps every value in range bit for bit (NaN stays NaN) and bounds the
rest. Every writer into the cache follows this rule: the compiled ``rope_store``
(``store`` for ``Half`` in kernels/cpu_kernels.cpp), the torch path's cache write
and restored warm blocks.
"""

from __future__ import annotations

import torch

FLOAT16_MAX = torch.finfo(torch.float16).max


def as_kv_values(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a cache of ``dtype`` stores it."""
    stored = x.to(dtype)
    if dtype == torch.float16:
        # Clamped after the conversion, in float16, whose ±65,504 is exact: clamping
        # before it, in x's dtype, rounds the bound itself (bfloat16 holds it as 65,536,
        # which then converts to infinity). An overflow became ±inf; inf clamps to ±65,504.
        stored = stored.clamp(-FLOAT16_MAX, FLOAT16_MAX)
    return stored
