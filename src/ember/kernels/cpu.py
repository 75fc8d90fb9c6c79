"""Fused CPU kernels (cpu_kernels.cpp, linear_lanes.cpp, linear_amx.cpp), compiled on first use and cached.

On a small model a decode step is dominated by the dispatch overhead of many
tiny ops (norms, rotary, cache writes, attention over a handful of tokens), not
by arithmetic. These kernels fuse each chain into one call. They are built with
torch's C++ extension tooling the first time they are needed (about a minute on
2 cores), cached under ``TORCH_EXTENSIONS_DIR`` keyed by the source's hash, and
used only on CPU tensors. ``EMBER_DISABLE_KERNELS=1`` turns them off; a build
failure is logged once and the plain torch path runs instead, with the same results.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path
from types import ModuleType

log = logging.getLogger("ember.kernels")

_SOURCES = [Path(__file__).with_name(name) for name in ("cpu_kernels.cpp", "linear_lanes.cpp", "linear_amx.cpp")]
# Included by the sources: part of the build's hash, not compiled on its own.
_HEADERS = [Path(__file__).with_name(name) for name in ("linear_amx.h", "simd_math.h")]
_lock = threading.Lock()
_module: ModuleType | None = None
_tried = False


def load() -> ModuleType | None:
    """The compiled module, or None when disabled or unbuildable (the reason is logged)."""
    global _module, _tried
    with _lock:
        if _tried:
            return _module
        _tried = True
        if os.environ.get("EMBER_DISABLE_KERNELS") == "1":
            return None
        try:
            from torch.utils.cpp_extension import load as build

            digest = hashlib.sha256(b"".join(path.read_bytes() for path in _SOURCES + _HEADERS)).hexdigest()[:12]
            _module = build(
                name=f"ember_cpu_kernels_{digest}",
                sources=[str(source) for source in _SOURCES],
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
        except Exception as exc:  # no compiler, no headers, ...: the torch path still works
            log.warning("compiled CPU kernels unavailable, using plain torch ops: %s", exc)
            _module = None
        return _module
