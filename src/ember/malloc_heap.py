"""glibc's malloc heap: how much of it is in use or free but held (``read``), and giving the free pages back (``trim``).

RSS alone cannot tell a leak from fragmentation. Torch's CPU tensors, the
tokenizer and Python's larger objects live on malloc's heap; when one is freed
in the middle of an arena, glibc keeps the pages (they are free, but resident)
until a trim. ``mallinfo2`` says which: ``uordblks`` (allocated) grows with a
leak, ``fordblks`` (free, held) with fragmentation. Large blocks served by
``mmap`` (``hblkhd``) are counted as in use.

The server's metrics read it (``process_native_heap_bytes``); the session
tiers trim it after dropping warm copies (``engine/heap_trim.py``). glibc only
(``mallinfo2`` since 2.33); elsewhere (musl, macOS) ``read`` returns None and
``trim`` False: the metric is absent rather than wrong, and nothing is trimmed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass
from functools import cache
from typing import Any


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
def _libc(name: str) -> Any | None:
    """A function of the C library by name, or None where the library or the function is missing."""
    path = ctypes.util.find_library("c")
    if path is None:
        return None
    try:
        return getattr(ctypes.CDLL(path), name)
    except (OSError, AttributeError):
        return None


@cache
def _mallinfo2() -> Any | None:
    fn = _libc("mallinfo2")
    if fn is not None:
        fn.restype = _Mallinfo2
        fn.argtypes = []
    return fn


@cache
def _malloc_trim() -> Any | None:
    fn = _libc("malloc_trim")
    if fn is not None:
        fn.argtypes = [ctypes.c_size_t]
        fn.restype = ctypes.c_int
    return fn


def read() -> NativeHeap | None:
    """The heap's figures now (it walks every arena's free lists: call it at scrape time, not per token)."""
    fn = _mallinfo2()
    if fn is None:
        return None
    info = fn()
    return NativeHeap(in_use_bytes=info.uordblks + info.hblkhd, free_bytes=info.fordblks)


def trim() -> bool:
    """Return every whole free page inside the heap (not only its top) to the system now; False without ``malloc_trim``."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True
