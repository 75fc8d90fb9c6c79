"""The front door keeps the engine's speed: `python -m benchmarks front-door --quick`, HTTP vs in process.

Both figures come from one run of the bench in a fresh process, in process and
HTTP taking turns over three rounds (this test process has run engines on its
main thread, which would slow an in-process engine here: see
engine/compute_threads.py). The bound is generous, 0.6x, so
that only a real loss fails it: the arrangement fixed in issue 11 lost 60 %
of single-stream decode through the server.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

MIN_RATIO = 0.6
REPO_ROOT = Path(__file__).resolve().parents[2]  # where `python -m benchmarks` finds the package


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_http_decode_and_16_streams_keep_the_in_process_speed(tmp_path):
    # Three alternating rounds, medians: one slow stretch of this shared machine (a round at a
    # quarter of the others' speed was seen here) moves no figure.
    cmd = [sys.executable, "-m", "benchmarks", "front-door", "--quick", "--skip-previous", "--runs", "2", "--rounds", "3", "--clients", "aiohttp", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    figures = json.loads((tmp_path / "front-door.json").read_text())
    print(done.stdout)
    for key in ("decode_tps", "streams16_tps"):
        engine, http = figures["in_process"][key], figures["http"][key]
        assert engine > 0 and http > 0, key
        assert http / engine >= MIN_RATIO, f"{key}: {http:.1f} through HTTP vs {engine:.1f} in process"
    assert "single-stream decode" in (tmp_path / "front-door.md").read_text()
