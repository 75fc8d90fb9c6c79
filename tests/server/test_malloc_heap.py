"""malloc's heap figures: what the soak uses to tell a leak (in use grows) from fragmentation (free grows)."""

from __future__ import annotations

import sys

import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ember import malloc_heap
from ember.server.metrics import ServerMetrics

MB = 1 << 20

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or malloc_heap.read() is None, reason="glibc only")


def test_a_native_allocation_shows_in_use_and_goes_when_freed():
    before = malloc_heap.read()
    block = torch.empty(64 * MB, dtype=torch.uint8)  # allocated by torch's CPU allocator, i.e. malloc
    block.fill_(1)
    during = malloc_heap.read()
    del block
    after = malloc_heap.read()
    assert before and during and after
    assert during.in_use_bytes - before.in_use_bytes >= 64 * MB
    assert during.in_use_bytes - after.in_use_bytes >= 64 * MB


def test_metrics_export_the_heap_by_state():
    text = generate_latest(ServerMetrics("m").registry).decode()
    samples = {
        s.labels["state"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "process_native_heap_bytes"
    }
    assert set(samples) == {"in_use", "free"}
    assert samples["in_use"] > 10 * MB  # torch and this interpreter are on it
