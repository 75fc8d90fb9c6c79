"""What a run cost outside the latencies: server and client CPU, bytes on the wire, connections.

Server CPU is read from Linux ``/proc`` without touching the server:
``/proc/<pid>/task/<tid>/schedstat`` holds each thread's time on a CPU in
nanoseconds (``/proc/<pid>/task/<tid>/stat`` utime + stime, in clock ticks,
where schedstat is missing). A snapshot maps thread id to CPU seconds; the
difference of two snapshots is what each thread spent in between (a thread
born in between counts from zero; one that ended in between is lost, which
does not happen to a serving process's threads during a run).

The split between the engine and the rest: the model's forward passes run
on the engine thread and its ``threads - 1`` OpenMP workers (``--threads``),
by far the busiest threads of the process. The ``threads`` busiest threads
other than the main one are counted as "engine"; everything else (the asyncio
loop with HTTP parsing, SSE/JSON or protobuf framing, granian's and gRPC's own
I/O threads) is "serving" CPU: the part a transport can change.

Bytes on the wire come from the kernel's TCP counters of the client's
sockets (``ss -ti``: ``bytes_sent`` and ``bytes_received`` per connection,
TLS records and HTTP/2 or gRPC framing included); the same listing counts
the connections the client holds to the server's port.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds of each live thread of process ``pid`` (see the module docstring)."""
    result: dict[int, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            result[int(task.name)] = _task_cpu_s(task)
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue  # the thread ended while we looked
    return result


def _task_cpu_s(task: Path) -> float:
    schedstat = task / "schedstat"
    if schedstat.exists():
        return int(schedstat.read_text().split()[0]) / 1e9
    fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS_PER_S  # utime, stime


@dataclass(frozen=True)
class ServerCPU:
    """CPU seconds a server process spent between two snapshots, split as the module docstring says."""

    total_s: float
    engine_s: float
    serving_s: float


def cpu_between(pid: int, before: dict[int, float], after: dict[int, float], engine_threads: int) -> ServerCPU:
    """The CPU of ``pid`` between two ``thread_cpu_s`` snapshots; the ``engine_threads`` busiest non-main threads are the engine."""
    spent = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    total = sum(spent.values())
    workers = sorted((s for tid, s in spent.items() if tid != pid), reverse=True)
    engine = sum(workers[:engine_threads])
    return ServerCPU(total, engine, total - engine)


@dataclass(frozen=True)
class WireCounters:
    """The client's TCP connections to one server port and their byte counters."""

    connections: int
    bytes_sent: int
    bytes_received: int
    # local port -> (sent, received), to subtract a snapshot taken before.
    per_socket: dict[int, tuple[int, int]]

    def since(self, earlier: WireCounters) -> WireCounters:
        """Bytes moved after ``earlier`` (sockets that appeared in between count from zero)."""
        sent = received = 0
        for local_port, (s, r) in self.per_socket.items():
            s0, r0 = earlier.per_socket.get(local_port, (0, 0))
            sent += s - s0
            received += r - r0
        return WireCounters(self.connections, sent, received, self.per_socket)


# "[STATE] Recv-Q Send-Q local:port peer:port" (ss omits the state column under a state filter).
_SOCKET_LINE = re.compile(r"^(?:[A-Z][A-Z0-9-]*\s+)?\d+\s+\d+\s+\S+:(\d+)\s+\S+:(\d+)")


def wire_counters(server_port: int) -> WireCounters | None:
    """The counters of every established TCP socket whose peer is ``server_port``; None without ``ss``."""
    ss = shutil.which("ss")
    if ss is None:
        return None
    out = subprocess.run(
        [ss, "-tinH", "state", "established", f"( dport = :{server_port} )"], capture_output=True, text=True, check=False
    ).stdout
    return parse_ss(out)


def parse_ss(text: str) -> WireCounters:
    """Parse ``ss -tinH state established`` output: a socket line, then its indented ``tcp_info`` line.

    With a state filter ``ss`` omits the state column, so a socket line reads
    ``Recv-Q Send-Q local:port peer:port``.
    """
    per_socket: dict[int, tuple[int, int]] = {}
    local_port: int | None = None
    for line in text.splitlines():
        match = None if line[:1].isspace() else _SOCKET_LINE.match(line)
        if match:
            local_port = int(match.group(1))
            continue
        if local_port is not None:
            sent = re.search(r"\bbytes_sent:(\d+)", line)
            received = re.search(r"\bbytes_received:(\d+)", line)
            per_socket[local_port] = (int(sent.group(1)) if sent else 0, int(received.group(1)) if received else 0)
            local_port = None
    return WireCounters(
        connections=len(per_socket),
        bytes_sent=sum(s for s, _ in per_socket.values()),
        bytes_received=sum(r for _, r in per_socket.values()),
        per_socket=per_socket,
    )
