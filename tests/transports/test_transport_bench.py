"""`ember bench --transport`, and the pieces of `python -m benchmarks transports`: CPU, wire counters, the report."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from ember.bench.loadgen import RunResult
from ember.bench.metrics import SLO
from ember.bench.record import RequestRecord
from benchmarks.resources import ServerCPU, WireCounters, cpu_between, parse_ss, thread_cpu_s
from ember.bench.result import make_group
from benchmarks.transports import Cell, CellResult, transports_table
from ember.cli import main
from server_process import ServerProcess
from transport_common import API_KEY

pytestmark = pytest.mark.timeout(120)

SS_OUTPUT = """\
0      0      127.0.0.1:41000 127.0.0.1:8000
\t cubic wscale:7,7 rto:204 rtt:0.05/0.02 mss:32768 bytes_sent:1200 bytes_acked:1201 bytes_received:45000 segs_out:10
0      0      127.0.0.1:41002 127.0.0.1:8000
\t cubic wscale:7,7 rto:204 rtt:0.05/0.02 mss:32768 bytes_sent:800 bytes_received:30000 segs_out:8
"""


def test_parse_ss_reads_each_sockets_counters() -> None:
    counters = parse_ss(SS_OUTPUT)
    assert counters.connections == 2
    assert (counters.bytes_sent, counters.bytes_received) == (2000, 75000)
    assert counters.per_socket == {41000: (1200, 45000), 41002: (800, 30000)}
    with_state = parse_ss("ESTAB 0 0 [::1]:41004 [::1]:8000\n\t bytes_sent:5 bytes_received:7\n")
    assert with_state.per_socket == {41004: (5, 7)}


def test_wire_counters_since_an_earlier_snapshot() -> None:
    earlier = WireCounters(1, 1000, 40000, {41000: (1000, 40000)})
    later = parse_ss(SS_OUTPUT)  # 41000 moved on; 41002 is new and counts from zero
    moved = later.since(earlier)
    assert (moved.bytes_sent, moved.bytes_received, moved.connections) == (200 + 800, 5000 + 30000, 2)


def test_cpu_between_counts_the_busiest_threads_as_the_engine() -> None:
    pid = 100
    before = {100: 1.0, 101: 10.0, 102: 5.0, 103: 0.5}
    after = {100: 1.3, 101: 14.0, 102: 7.0, 103: 0.6, 104: 0.2}  # 104: born during the run
    cpu = cpu_between(pid, before, after, engine_threads=2)
    assert cpu.engine_s == pytest.approx(4.0 + 2.0)
    assert cpu.serving_s == pytest.approx(0.3 + 0.1 + 0.2)
    assert cpu.total_s == pytest.approx(cpu.engine_s + cpu.serving_s)


def test_thread_cpu_s_sees_a_busy_thread() -> None:
    done = threading.Event()

    def spin() -> None:
        while not done.is_set():
            sum(range(1000))

    before = thread_cpu_s(os.getpid())
    worker = threading.Thread(target=spin)
    worker.start()
    threading.Event().wait(0.3)
    after = thread_cpu_s(os.getpid())
    done.set()
    worker.join()
    spent = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    assert max(spent.values()) > 0.05  # ~0.3 s of spinning, measured per thread


def _cell(transport: str, ttft_s: float, serving_s: float, tokens: int = 100) -> CellResult:
    records = []
    for i in range(2):
        record = RequestRecord(index=i, start_s=0.0, end_s=1.0, chunk_times_s=[ttft_s, ttft_s + 0.1], output_tokens=tokens // 2, status=200, finish_reason="length")
        records.append(record)
    cell = Cell(transport, tls=False, concurrency=2)
    group = make_group(cell.label, {}, RunResult(records, 0.0, 1.0), SLO())
    return CellResult(cell, group, tokens, ServerCPU(total_s=1.0 + serving_s, engine_s=1.0, serving_s=serving_s), 0.01, WireCounters(1, 3000, 30000, {}))


def test_the_report_shows_per_token_costs_against_http1() -> None:
    table = transports_table([_cell("http1", 0.100, 0.010), _cell("grpc", 0.080, 0.005)])
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]] for line in table.splitlines()[2:]}
    grpc_row = rows["grpc"]
    assert grpc_row[4:6] == ["80.0", "-20%"]  # TTFT p50 and its change
    assert grpc_row[11:13] == ["50.0", "-50%"]  # serving CPU µs/token and its change
    assert grpc_row[14:17] == ["300", "30", "1"]  # bytes/token down, up; connections
    numbers = _cell("grpc", 0.08, 0.005).numbers()
    assert numbers["server_cpu_us_per_token"] == pytest.approx(10050.0)


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def test_bench_load_over_grpc(grpc_server: ServerProcess, tmp_path: Path) -> None:
    out = tmp_path / "grpc"
    argv = ["bench", "load", "--transport", "grpc", "--url", grpc_server.grpc_url, "--api-key", API_KEY,
            "--requests", "3", "--concurrency", "1", "--max-tokens", "5", "--out", str(out), "--quiet"]  # fmt: skip
    assert main(argv) == 0
    summary = _summary(out)
    assert summary["config"]["transport"] == "grpc" and summary["config"]["server_is_ember"] is True
    records = json.loads((out / "requests.json").read_text())
    assert [r["output_tokens"] for r in records] == [5, 5, 5]
    assert all(r["error_kind"] is None and r["ttft_s"] > 0 and len(r["chunk_times_s"]) >= 1 for r in records)


def test_bench_over_grpc_records_errors_by_kind(grpc_server: ServerProcess, tmp_path: Path) -> None:
    out = tmp_path / "unauthenticated"
    argv = ["bench", "single", "--transport", "grpc", "--url", grpc_server.grpc_url, "--requests", "1", "--max-tokens", "2",
            "--warmup", "0", "--out", str(out), "--quiet"]  # fmt: skip
    assert main(argv) == 1  # nothing completed
    (record,) = json.loads((out / "requests.json").read_text())
    assert (record["error_kind"], record["status"]) == ("http_401", 401)


def test_bench_load_over_http2(h2_server: ServerProcess, tmp_path: Path) -> None:
    out = tmp_path / "h2"
    argv = ["bench", "load", "--transport", "http2", "--url", h2_server.url, "--requests", "4", "--concurrency", "4",
            "--max-tokens", "4", "--out", str(out), "--quiet"]  # fmt: skip
    assert main(argv) == 0
    summary = _summary(out)
    assert summary["config"]["transport"] == "http2" and summary["config"]["http2"] is True
    (group,) = summary["groups"]
    assert group["summary"]["completed"] == 4
    assert group["summary"]["new_connections"] <= 1  # four streams, at most one new connection (the warm-up's is reused)
