"""``python -m benchmarks transports``: the same streaming workload over HTTP/1.1 SSE, HTTP/2 and gRPC.

It starts its own servers (``benchmarks.servers``; it must know their process
ids to read their CPU time; logs in ``$EMBER_TEST_LOGS``, default /tmp/ember-test-logs): per TLS mode one ``ember serve --grpc-port`` (uvicorn, the HTTP/1.1
path, plus the gRPC server in the same process) and one ``ember serve
--http2`` (granian). TLS uses a throwaway self-signed certificate made with
the ``openssl`` CLI. Then, for each TLS mode, each number of concurrent
streams and each transport (interleaved, so drift hits all alike), one
*cell*:

1. a fresh client (its own connection pool) sends ``concurrency`` short
   requests at once, untimed: it opens the connections the load will use
   (HTTP/1.1 needs one per stream, HTTP/2 and gRPC one in all) and warms the path;
2. snapshots: the server's per-thread CPU, the client's CPU, the kernel's
   byte counters of the client's sockets (``resources.py``);
3. a closed loop of ``requests`` story requests (``max_tokens``, ignore_eos,
   so every reply has the same length) at ``concurrency``;
4. snapshots again; the differences divided by the tokens streamed give CPU
   and bytes per token.

Latencies are therefore of warm connections: handshakes are not in TTFT
(they are what ``--new-connection-per-request`` on other workloads shows).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.resources import ServerCPU, WireCounters, cpu_between, thread_cpu_s, wire_counters
from benchmarks.servers import ServerProcess
from benchmarks.tls_cert import self_signed_cert
from ember.bench.cli import add_plots_argument, default_out_dir, plots_wanted, write_outputs
from ember.bench.loadgen import run_closed_loop
from ember.bench.metrics import SLO
from ember.bench.progress import BenchProgress
from ember.bench.record import Clock
from ember.bench.report import fmt_ms, fmt_number, markdown_table
from ember.bench.result import BenchResult, Group, Section, make_group
from ember.bench.sender import BenchError, Target, make_sender
from ember.bench.workloads import RequestSpec, story_requests
from ember.client.transport import TRANSPORTS


@dataclass(frozen=True)
class Cell:
    transport: str
    tls: bool
    concurrency: int

    @property
    def label(self) -> str:
        return f"{self.transport} {'tls' if self.tls else 'clear'} c={self.concurrency}"


@dataclass
class CellResult:
    """One cell's group of requests and what it cost."""

    cell: Cell
    group: Group
    tokens: int
    server: ServerCPU
    client_cpu_s: float
    wire: WireCounters | None

    def per_token(self, amount: float | None) -> float | None:
        return None if amount is None or self.tokens == 0 else amount / self.tokens

    def numbers(self) -> dict[str, Any]:
        """Per-token costs for summary.json (CPU in µs, bytes)."""
        us = 1e6
        return {
            **asdict(self.cell),
            "tokens": self.tokens,
            "server_cpu_us_per_token": _scaled(self.per_token(self.server.total_s), us),
            "server_serving_cpu_us_per_token": _scaled(self.per_token(self.server.serving_s), us),
            "server_engine_cpu_us_per_token": _scaled(self.per_token(self.server.engine_s), us),
            "client_cpu_us_per_token": _scaled(self.per_token(self.client_cpu_s), us),
            "bytes_down_per_token": self.per_token(self.wire.bytes_received if self.wire else None),
            "bytes_up_per_token": self.per_token(self.wire.bytes_sent if self.wire else None),
            "connections": self.wire.connections if self.wire else None,
        }


def add_transports_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--transports", default=",".join(TRANSPORTS), help="comma-separated, of http1,http2,grpc (default %(default)s)")
    p.add_argument("--concurrency", default="1,64", help="comma-separated numbers of concurrent streams (default %(default)s)")
    p.add_argument("--tls", default="off,on", help="off, on or off,on (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per reply (ignore_eos) (default %(default)s)")
    p.add_argument("--rounds", type=int, default=2, help="requests per stream in a cell (default %(default)s)")
    p.add_argument("--min-requests", type=int, default=8, help="at least this many requests per cell (default %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="the servers' --threads (the engine's CPU threads) (default %(default)s)")
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra 'ember serve' argument, repeatable (e.g. --server-arg=--quantization=none)",
    )
    p.add_argument("--out", type=Path, default=None, help="result directory (default bench-results/transports-<timestamp>)")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no summary on stdout")
    add_plots_argument(p)


def transports_main(args: argparse.Namespace) -> int:
    try:
        plots = plots_wanted("python -m benchmarks transports", args.plots, quiet=args.quiet)
        transports = _choices(args.transports, TRANSPORTS, "--transports")
        tls_modes = [mode == "on" for mode in _choices(args.tls, ("off", "on"), "--tls")]
        concurrencies = [int(c) for c in args.concurrency.split(",") if c.strip()]
        if not concurrencies or min(concurrencies) < 1:
            raise BenchError("--concurrency needs integers >= 1")
        args.out = args.out or default_out_dir("transports")
        result = run_transports(transports, tls_modes, concurrencies, args)
    except BenchError as exc:
        print(f"python -m benchmarks transports: {exc}", file=sys.stderr)
        return 2
    return write_outputs(result, args.out, quiet=args.quiet, plots=plots)


def run_transports(transports: list[str], tls_modes: list[bool], concurrencies: list[int], args: argparse.Namespace) -> BenchResult:
    """Start the servers, run every cell, stop the servers; the result has one group per cell."""
    # 64 streams must all run at once (the default admits 32), else TTFT measures the queue.
    server_args = ["--warmup-requests", "2", "--max-running", str(max(concurrencies)), *args.server_arg]
    results: list[CellResult] = []
    with tempfile.TemporaryDirectory(prefix="ember-bench-tls-") as tmp:
        tls_files = self_signed_cert(Path(tmp)) if any(tls_modes) else None
        servers: dict[tuple[bool, str], ServerProcess] = {}
        try:
            for tls in tls_modes:
                files = (str(tls_files[0]), str(tls_files[1])) if tls and tls_files else None
                if {"http1", "grpc"} & set(transports):
                    servers[(tls, "uvicorn")] = ServerProcess(*server_args, threads=args.threads, grpc=True, tls=files)
                if "http2" in transports:
                    servers[(tls, "granian")] = ServerProcess(*server_args, "--http2", threads=args.threads, tls=files)
            for server in servers.values():  # they load concurrently; waiting in turn costs nothing
                _wait_ready(server)
            clock = Clock()
            with BenchProgress(quiet=args.quiet) as progress:
                for tls in tls_modes:
                    for concurrency in concurrencies:
                        for transport in transports:
                            cell = Cell(transport, tls, concurrency)
                            server = servers[(tls, "granian" if transport == "http2" else "uvicorn")]
                            requests = max(args.min_requests, args.rounds * concurrency)
                            results.append(asyncio.run(run_cell(cell, server, args, requests, clock, progress)))
        finally:
            for server in servers.values():
                server.stop()
    config = {
        "transports": transports, "tls": tls_modes, "concurrency": concurrencies, "max_tokens": args.max_tokens,
        "rounds": args.rounds, "threads": args.threads, "server_args": server_args,
    }  # fmt: skip
    return BenchResult(
        "transports",
        config,
        [r.group for r in results],
        plots=["latency_cdf"],
        sections=[Section("Transports: what each costs per streamed token", transports_table(results) + "\n\n" + NOTES)],
        extras={"cells": [r.numbers() for r in results]},
    )


async def run_cell(
    cell: Cell, server: ServerProcess, args: argparse.Namespace, requests: int, clock: Clock, progress: BenchProgress
) -> CellResult:
    """Warm a fresh client's connections, then measure one closed-loop run (see the module docstring)."""
    url = server.grpc_url if cell.transport == "grpc" else server.url
    port = server.grpc_port if cell.transport == "grpc" else server.port
    assert port is not None
    cacert = server.tls[0] if server.tls else None
    target = Target(url=url, transport=cell.transport, http2=cell.transport == "http2", cacert=cacert, timeout_s=120.0)
    async with make_sender(target, clock) as sender:
        warm = RequestSpec([{"role": "user", "content": "Say hello."}], max_tokens=2)
        warmed = await asyncio.gather(*(sender.send(warm, index=-1 - i) for i in range(cell.concurrency)))
        failed = [r for r in warmed if not r.ok]
        if failed:
            raise BenchError(f"{cell.label}: warm-up failed ({failed[0].error_kind}): {failed[0].error}")
        progress.phase(cell.label, requests)
        cpu_before, client_before, wire_before = thread_cpu_s(server.proc.pid), time.process_time(), wire_counters(port)
        run = await run_closed_loop(
            sender.send, story_requests(args.max_tokens, ignore_eos=True), concurrency=cell.concurrency, clock=clock,
            max_requests=requests, on_record=progress.on_record,
        )  # fmt: skip
        cpu_after, client_after, wire_after = thread_cpu_s(server.proc.pid), time.process_time(), wire_counters(port)
    group = make_group(cell.label, {**asdict(cell), "requests": requests, "max_tokens": args.max_tokens}, run, SLO())
    tokens = sum(r.output_tokens or 0 for r in run.records if r.ok)
    wire = wire_after.since(wire_before) if wire_after is not None and wire_before is not None else None
    return CellResult(
        cell, group, tokens, cpu_between(server.proc.pid, cpu_before, cpu_after, args.threads), client_after - client_before, wire
    )


def transports_table(results: list[CellResult]) -> str:
    """One row per cell; Δ columns compare with HTTP/1.1 at the same TLS mode and concurrency."""
    baseline = {(r.cell.tls, r.cell.concurrency): r for r in results if r.cell.transport == "http1"}
    rows = []
    for r in results:
        s, n = r.group.summary, r.numbers()
        base = baseline.get((r.cell.tls, r.cell.concurrency))
        base_n = base.numbers() if base is not None else None
        rows.append([
            r.cell.transport, "on" if r.cell.tls else "off", str(r.cell.concurrency), f"{s.completed}/{s.requests}",
            fmt_ms(s.ttft.p50), _delta(s.ttft.p50, base.group.summary.ttft.p50 if base else None), fmt_ms(s.ttft.p99),
            fmt_ms(s.itl.p50), fmt_ms(s.itl.p99), fmt_number(s.output_throughput, 0),
            fmt_number(n["server_cpu_us_per_token"], 0), fmt_number(n["server_serving_cpu_us_per_token"], 1),
            _delta(n["server_serving_cpu_us_per_token"], base_n["server_serving_cpu_us_per_token"] if base_n else None),
            fmt_number(n["client_cpu_us_per_token"], 1), fmt_number(n["bytes_down_per_token"], 0), fmt_number(n["bytes_up_per_token"], 0),
            "–" if n["connections"] is None else str(n["connections"]),
        ])  # fmt: skip
    headers = [
        "transport", "TLS", "streams", "ok", "TTFT p50 (ms)", "Δ vs http1", "TTFT p99 (ms)", "ITL p50 (ms)", "ITL p99 (ms)",
        "output tok/s", "server CPU µs/tok", "serving CPU µs/tok", "Δ vs http1", "client CPU µs/tok",
        "bytes/tok down", "bytes/tok up", "connections",
    ]  # fmt: skip
    return markdown_table(headers, rows)


NOTES = """\
- *server CPU*: the whole server process (`/proc/<pid>/task/*/schedstat`), divided by the tokens streamed.
  *serving CPU* leaves out the engine (the `--threads` busiest threads besides the main one: the engine
  thread and its OpenMP workers): the asyncio loop, HTTP parsing, SSE/JSON or protobuf framing, granian's
  and gRPC's I/O threads. That is the part a transport can change.
- *client CPU*: this benchmark process (`time.process_time`): the client library, parsing, bookkeeping.
- *bytes/tok*: the kernel's TCP byte counters of the client's sockets (`ss -ti`), TLS and framing included;
  down is server to client. *connections*: the client's sockets to the server port at the end of the cell.
- Δ columns: relative to HTTP/1.1 (uvicorn) at the same TLS mode and number of streams; negative is better.
- HTTP/1.1 and gRPC are served by the same process (uvicorn plus `--grpc-port`), HTTP/2 by `ember serve --http2` (granian)."""


def _wait_ready(server: ServerProcess) -> None:
    try:
        server.wait_ready()
    except (RuntimeError, TimeoutError) as exc:
        raise BenchError(f"a server did not start (log {server.log_path}): {exc}") from None


def _choices(text: str, allowed: tuple[str, ...], option: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in values if v not in allowed]
    if not values or bad:
        raise BenchError(f"{option}: expected a comma-separated list of {', '.join(allowed)}, got {text!r}")
    return values


def _delta(value: float | None, base: float | None) -> str:
    if value is None or base is None or base == 0:
        return "–"
    return f"{(value - base) / base * 100:+.0f}%"


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor
