"""`python -m benchmarks restore-stall --runs 1`: both arrangements run and are reported, and the previous one is put back."""

from __future__ import annotations

import pytest

from benchmarks.cli import main
from ember.engine import compute_threads
from ember.engine import warm_storage as ws


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_restore_stall_bench_reports_both_arrangements(capsys):
    idle, chunk = compute_threads.run_in_idle_time, ws.CHUNK_BYTES
    assert main(["restore-stall", "--runs", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| now") or line.startswith("| previous")]
    assert len(rows) == 2, out
    for row in rows:
        ratio = float(row.split("|")[2].strip().rstrip("x"))
        assert ratio > 0  # a figure, not a bound (see tests/engine/test_restore_off_step_loop.py)
    assert compute_threads.run_in_idle_time is idle and ws.CHUNK_BYTES == chunk
