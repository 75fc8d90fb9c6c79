"""The C heap as glibc's malloc sees it: bytes in use, and bytes free but still held.

RSS alone cannot tell a leak from fragmentation. Torch's CPU tensors, the
tokenizer and Python's larger objects live on malloc's heap; when one is freed
in the middle of an arena, glibc keeps the pages (they are free, but resident)
until a trim. ``mallinfo2`` says which: ``uordblks`` (allocated) grows with a
leak, ``fordblks`` (free, held) with fragmentation. Large blocks served by
``mmap`` (``hblkhd``) are counted as in use.

glibc ≥ 2.33 only; elsewhere (musl, macOS) ``read`` returns None and the
metric is absent rather than wrong.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass
from functools import cache


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
    ]


@dataclass(frozen=True)
class NativeHeap:
    in_use_bytes: int  # allocated blocks, mmap-served ones included
    free_bytes: int  # free blocks inside the arenas: resident until trimmed


@cache
def _mallinfo2() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        fn = ctypes.CDLL(name).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _Mallinfo2
    fn.argtypes = []
    return fn


def read() -> NativeHeap | None:
    """The heap's figures now (it walks every arena's free lists: call it at scrape time, not per token)."""
    fn = _mallinfo2()
    if fn is None:
        return None
    info = fn()
    return NativeHeap(in_use_bytes=info.uordblks + info.hblkhd, free_bytes=info.fordblks)
