"""``python -m benchmarks soak``: a bounded mixed load for a long time, watching the server's memory and descriptors.

``--concurrency`` clients, closed loop, for ``--duration`` seconds. Each
request is one of: a streamed one-shot question, a whole-reply (non-streamed)
one, or the next turn of a multi-turn conversation (``X-Session-ID``, its
history growing for ``--turns`` turns, then a new conversation), so the
session tiers fill as they do in production. About ``--cancel-share`` of the
requests are abandoned by their client midway (a stream closed after a few
chunks, a whole reply given up after a random short wait), the way users
leave. Every ``--sample-interval`` seconds the server process's RSS and open
file descriptors and the warm tier's RAM (``llm_session_bytes{tier="warm"}``)
are sampled.

The report (benchmarks/soak_report.py): errors, p50/p99 latencies per minute, the
RSS slope after ``--warmup`` raw and net of the warm tier (which fills its
budget by design), raw RSS against the configured budgets, fds flat. It
starts its own ``ember serve`` (extra flags with ``--server-arg``), or
watches a running one given ``--url`` and its ``--pid``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import httpx

from benchmarks.servers import ServerProcess
from benchmarks.soak_report import MB, ResourceSample, SoakRequest, per_minute, render_markdown, to_json, verdict
from ember.config import SessionConfig

TOPICS = ("the sea", "volcanoes", "a lighthouse keeper", "bread", "the moon", "trains", "owls", "a small town", "rain", "chess")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("load")
    g.add_argument("--duration", type=float, default=120.0, help="seconds of load (default %(default)s; the soak objective is 1800)")
    g.add_argument("--concurrency", type=int, default=4, help="clients, closed loop (default %(default)s)")
    g.add_argument("--max-tokens", type=int, default=48, help="max_tokens of every request (default %(default)s)")
    g.add_argument("--turns", type=int, default=5, help="turns per conversation before a new one (default %(default)s)")
    g.add_argument("--cancel-share", type=float, default=0.08, help="share of requests the client abandons midway (default %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="seed of the request mix (default %(default)s)")
    m = parser.add_argument_group("measurement")
    m.add_argument(
        "--warmup", type=float, default=None, help="seconds excluded from the slopes (default: a fifth of --duration, at most 120)"
    )
    m.add_argument("--sample-interval", type=float, default=5.0, help="seconds between resource samples (default %(default)s)")
    m.add_argument("--out", type=Path, default=None, help="result directory (default bench-results/soak-<timestamp>)")
    s = parser.add_argument_group("server")
    s.add_argument("--url", default=None, help="watch a running server (up to /v1) instead of starting one; needs --pid")
    s.add_argument("--pid", type=int, default=None, help="process id of the server at --url (RSS and fds are read from /proc)")
    s.add_argument("--threads", type=int, default=2, help="torch threads of the server it starts (default %(default)s)")
    s.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra flag for the server it starts, repeatable (e.g. --server-arg=--warm-memory-mb=256)",
    )
    s.add_argument(
        "--warm-memory-mb",
        type=int,
        default=None,
        help="the server's warm-tier RAM budget, for the RSS bound (default: from --server-arg, else the serve default)",
    )


@dataclass
class _Conversation:
    session_id: str
    messages: list[dict[str, str]] = field(default_factory=list)
    turns: int = 0


class SoakLoad:
    """The clients: each loops on requests until the deadline, recording every one."""

    def __init__(self, url: str, args: argparse.Namespace, started: float) -> None:
        self.url = url.rstrip("/")
        self.args = args
        self.started = started
        self.requests: list[SoakRequest] = []
        self._conversations = 0

    def _now(self) -> float:
        return time.monotonic() - self.started

    async def client(self, index: int, http: httpx.AsyncClient, until: float) -> None:
        rng = random.Random(self.args.seed * 1000 + index)
        conversation: _Conversation | None = None
        while time.monotonic() < until:
            cancel = rng.random() < self.args.cancel_share
            roll = rng.random()
            if conversation is not None or roll < 0.35:
                if conversation is None:
                    self._conversations += 1
                    conversation = _Conversation(f"soak-{self.args.seed}-{self._conversations}")
                conversation.messages.append({"role": "user", "content": f"Tell me one more thing about {rng.choice(TOPICS)}."})
                record, text = await self._stream(http, rng, {"messages": conversation.messages}, cancel, "turn", conversation.session_id)
                conversation.turns += 1
                if record.cancelled or record.error or conversation.turns >= self.args.turns:
                    conversation = None  # the user left, or the conversation is over
                else:
                    conversation.messages.append({"role": "assistant", "content": text})
            elif roll < 0.7:
                question = [{"role": "user", "content": f"Question {rng.randrange(10**6)}: write a few lines about {rng.choice(TOPICS)}."}]
                record, _ = await self._stream(http, rng, {"messages": question}, cancel, "stream", None)
            else:
                question = [{"role": "user", "content": f"Question {rng.randrange(10**6)}: what is {rng.choice(TOPICS)}?"}]
                record = await self._full(http, rng, {"messages": question}, cancel)
            self.requests.append(record)

    async def _stream(
        self, http: httpx.AsyncClient, rng: random.Random, body: dict, cancel: bool, kind: str, session_id: str | None
    ) -> tuple[SoakRequest, str]:
        start = self._now()
        t0 = time.monotonic()
        ttft: float | None = None
        text: list[str] = []
        stop_after = rng.randint(1, 8) if cancel else None
        status, error, done, chunks = 0, None, False, 0
        headers = {"X-Session-ID": session_id} if session_id else {}
        payload = {**body, "stream": True, "max_tokens": self.args.max_tokens}
        try:
            async with http.stream("POST", f"{self.url}/chat/completions", json=payload, headers=headers) as r:
                status = r.status_code
                if status != 200:
                    error = f"http {status}: {(await r.aread()).decode(errors='replace')[:200]}"
                else:
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        if line == "data: [DONE]":
                            done = True
                            break
                        event = json.loads(line[6:])
                        if "error" in event:
                            error = f"error chunk: {event['error'].get('message')}"
                            continue
                        for choice in event.get("choices", []):
                            piece = choice.get("delta", {}).get("content")
                            if piece:
                                ttft = ttft if ttft is not None else time.monotonic() - t0
                                text.append(piece)
                        chunks += 1
                        if stop_after is not None and chunks >= stop_after:
                            break  # the client leaves: closing the response aborts the request
                    if stop_after is None and not done and error is None:
                        error = "stream ended without [DONE]"
        except httpx.HTTPError as exc:
            error = f"{type(exc).__name__}: {exc}"
        cancelled = stop_after is not None and not done
        return SoakRequest(kind, start, time.monotonic() - t0, ttft, status, cancelled, None if cancelled else error), "".join(text)

    async def _full(self, http: httpx.AsyncClient, rng: random.Random, body: dict, cancel: bool) -> SoakRequest:
        start = self._now()
        t0 = time.monotonic()
        payload = {**body, "max_tokens": self.args.max_tokens}
        call = http.post(f"{self.url}/chat/completions", json=payload)
        try:
            r = await (asyncio.wait_for(call, rng.uniform(0.05, 0.6)) if cancel else call)
        except TimeoutError:
            return SoakRequest("full", start, time.monotonic() - t0, None, 0, cancelled=True)
        except httpx.HTTPError as exc:
            return SoakRequest("full", start, time.monotonic() - t0, None, 0, error=f"{type(exc).__name__}: {exc}")
        error = None if r.status_code == 200 else f"http {r.status_code}: {r.text[:200]}"
        return SoakRequest("full", start, time.monotonic() - t0, None, r.status_code, error=error)


def read_process(pid: int) -> tuple[int, int]:
    """(resident bytes, open file descriptors) of a process, from /proc."""
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
                break
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def sample_server(pid: int, metrics_text: str, at_s: float) -> ResourceSample:
    """One sample: RSS and fds from /proc, the warm tier's RAM and malloc's heap from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    rss, fds = read_process(pid)
    warm = heap_in_use = heap_free = 0
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == "llm_session_bytes" and sample.labels.get("tier") == "warm":
                warm = int(sample.value)
            elif sample.name == "process_native_heap_bytes":
                if sample.labels.get("state") == "in_use":
                    heap_in_use = int(sample.value)
                else:
                    heap_free = int(sample.value)
    return ResourceSample(at_s, rss, fds, warm, heap_in_use, heap_free)


async def sample_resources(
    pid: int, base: str, http: httpx.AsyncClient, started: float, until: float, every_s: float, out: list[ResourceSample]
) -> None:
    """Sample the server every ``every_s`` until ``until``, and once more at the end."""
    while True:
        text = (await http.get(f"{base}/metrics")).text
        out.append(sample_server(pid, text, time.monotonic() - started))
        if time.monotonic() >= until:
            return
        await asyncio.sleep(min(every_s, max(0.0, until - time.monotonic())))


def _warm_budget_mb(args: argparse.Namespace) -> int:
    if args.warm_memory_mb is not None:
        return args.warm_memory_mb
    flags = " ".join(args.server_arg).replace("=", " ").split()
    if "--warm-memory-mb" in flags:
        return int(flags[flags.index("--warm-memory-mb") + 1])
    return SessionConfig().warm_memory_bytes // MB


async def _soak(args: argparse.Namespace, url: str, pid: int) -> tuple[list[SoakRequest], list[ResourceSample]]:
    base = url.rstrip("/").removesuffix("/v1")
    started = time.monotonic()
    until = started + args.duration
    load = SoakLoad(url, args, started)
    samples: list[ResourceSample] = []
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as http, httpx.AsyncClient(timeout=30) as probe:
        reporter = asyncio.ensure_future(_report_minutes(load, until))
        await asyncio.gather(
            *(load.client(i, http, until) for i in range(args.concurrency)),
            sample_resources(pid, base, probe, started, until, args.sample_interval, samples),
        )
        reporter.cancel()
        # One last sample once every client is done, so the end of the run is in the slope.
        samples.append(sample_server(pid, (await probe.get(f"{base}/metrics")).text, time.monotonic() - started))
    return load.requests, samples


async def _report_minutes(load: SoakLoad, until: float) -> None:
    """A progress line per minute on stderr."""
    minute = 0
    while time.monotonic() < until:
        await asyncio.sleep(60)
        rows = per_minute([r for r in load.requests if int(r.started_s // 60) == minute])
        if rows:
            m = rows[-1]
            p99 = "-" if m.p99_e2e_s is None else f"{m.p99_e2e_s * 1000:.0f} ms"
            print(
                f"soak: minute {minute}: {m.requests} requests, {m.errors} errors, {m.cancelled} cancelled, p99 e2e {p99}",
                file=sys.stderr,
                flush=True,
            )
        minute += 1


def main(args: argparse.Namespace) -> int:
    if (args.url is None) != (args.pid is None):
        print("python -m benchmarks soak: --url and --pid go together (or give neither and it starts a server)", file=sys.stderr)
        return 2
    if args.duration <= 0 or args.concurrency < 1 or not 0 <= args.cancel_share < 1:
        print("python -m benchmarks soak: --duration > 0, --concurrency >= 1 and 0 <= --cancel-share < 1", file=sys.stderr)
        return 2
    warmup_s = args.warmup if args.warmup is not None else min(120.0, args.duration / 5)
    out_dir = args.out or Path(f"bench-results/soak-{datetime.now():%Y%m%d-%H%M%S}")
    budget = _warm_budget_mb(args) * MB
    server: ServerProcess | None = None
    if args.url is None:
        server = ServerProcess("--warmup-requests", "1", "--request-timeout", "60", *args.server_arg, threads=args.threads).wait_ready()
        url, pid = server.url, server.proc.pid
    else:
        url, pid = args.url, args.pid
    try:
        requests, samples = asyncio.run(_soak(args, url, pid))
    finally:
        if server is not None:
            server.stop()
    result = verdict(requests, samples, warmup_s=warmup_s, budget_bytes=budget)
    config = {
        "duration_s": args.duration,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "turns": args.turns,
        "cancel_share": args.cancel_share,
        "warmup_s": warmup_s,
        "warm_budget_mb": budget // MB,
        "seed": args.seed,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    report = render_markdown(requests, samples, result, config=config)
    (out_dir / "summary.md").write_text(report)
    (out_dir / "soak.json").write_text(json.dumps(to_json(requests, samples, result, config=config), indent=1))
    print(report)
    print(f"wrote {out_dir}/: summary.md, soak.json")
    return 0 if result.passed else 1
