"""`python -m benchmarks speculation --runs 1 --skip-in-process`: both servers run every workload, the answers match."""

from __future__ import annotations

import json

import pytest

from benchmarks.cli import main
from benchmarks.speculation_bench import WORKLOADS


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_speculation_bench_reports_every_workload_and_identical_answers(tmp_path, capsys):
    out = tmp_path / "speculation.json"
    assert main(["speculation", "--runs", "1", "--skip-in-process", "--out", str(out)]) == 0  # 1: the answers differed
    report = json.loads(out.read_text())
    assert [row["workload"] for row in report] == [w.name for w in WORKLOADS]
    for row in report:
        assert row["on"]["text"] == row["off"]["text"] and row["ratio"] > 0
        assert row["off"]["drafted"] == 0
    grounded = [row for row in report if row["target"] == 1.8]
    assert all(row["on"]["accepted"] > 0 for row in grounded)  # the input-grounded answers did speculate
    assert "answers identical on and off: yes" in capsys.readouterr().out
