"""`python -m benchmarks linears` with few rows and one round: it runs and reports every figure."""

from __future__ import annotations

import json
import platform
import shutil
from pathlib import Path

import pytest

from benchmarks.cli import main


def _can_probe() -> bool:
    flags = Path("/proc/cpuinfo").read_text(errors="ignore") if Path("/proc/cpuinfo").exists() else ""
    return platform.machine() == "x86_64" and " avx2 " in flags and " fma " in flags and shutil.which("c++") is not None


@pytest.mark.timeout(300)
def test_linears_bench_writes_figures(tmp_path, capsys):
    out = tmp_path / "linears.json"
    assert main(["linears", "--rows", "1,16", "--rounds", "1", "--out", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert set(figures["layers"]) == {
        "W8A16 kernel, weights from memory",
        "the same without the weight prefetch (an earlier default)",
        "W8A16 kernel, one layer in cache",
        "fbgemm int8 activations (w8a8)",
    }
    for by_rows in figures["layers"].values():
        assert set(by_rows) == {"1", "16"} and all(value > 0 for value in by_rows.values())
    assert all(value > 0 for by_rows in figures["lm_head"].values() for value in by_rows.values())
    ceilings = figures["ceilings"]
    if _can_probe():
        assert ceilings["clock_ghz"] > 0.5
        # Every probe issues at least one vector instruction per cycle on any AVX2 core.
        assert ceilings["int16_madd"] >= 8 and ceilings["int8_maddubs"] >= 8 and ceilings["float32_fma"] >= 8
    else:
        assert ceilings is None
    assert "Instruction-mix ceilings" in capsys.readouterr().out or ceilings is None
