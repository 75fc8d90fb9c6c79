"""Freed warm copies give their pages back: the trim rule, and what malloc_trim does to a fragmented heap."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from ember import malloc_heap
from ember.engine.heap_trim import HeapTrimmer
from test_sessions import FakeClock

MB = 1 << 20


def test_trims_once_enough_was_dropped_and_enough_time_passed():
    clock, calls = FakeClock(), []
    trimmer = HeapTrimmer(threshold_bytes=10 * MB, min_interval_s=5.0, clock=clock, do_trim=lambda: calls.append(clock.t) or True)
    assert not trimmer.freed(6 * MB)  # under the threshold
    assert trimmer.freed(6 * MB)  # 12 MB: trims, although nothing was trimmed before
    assert not trimmer.freed(20 * MB)  # over the threshold but 0 s after the last trim
    clock.advance(4.9)
    assert not trimmer.freed(1)
    clock.advance(0.1)
    assert trimmer.freed(1)  # the bytes kept counting meanwhile
    assert calls == [1000.0, pytest.approx(1005.0)] and trimmer.trims == 2 and trimmer.pending_bytes == 0


def test_without_malloc_trim_nothing_is_retried_per_copy():
    clock = FakeClock()
    trimmer = HeapTrimmer(threshold_bytes=MB, min_interval_s=0.0, clock=clock, do_trim=lambda: False)
    assert not trimmer.freed(2 * MB) and trimmer.pending_bytes == 0 and trimmer.trims == 0


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not sys.platform.startswith("linux") or malloc_heap._malloc_trim() is None, reason="glibc only")
def test_trim_returns_the_holes_of_a_fragmented_heap():
    big = torch.empty(16 * MB, dtype=torch.uint8)
    del big  # glibc now serves blocks up to 16 MB from the heap, as it does for warm copies
    copies = [torch.ones(2 * MB, dtype=torch.uint8) for _ in range(80)]  # touched: resident
    del copies[::2]  # 80 MB of holes between live copies
    before = _rss()
    assert malloc_heap.trim()
    assert before - _rss() >= 40 * MB, "malloc_trim gave back less than half of the holes"
    del copies
