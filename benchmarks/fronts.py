"""``python -m benchmarks fronts``: what each front adds: ``ember route``, Ray Serve, against one ``ember serve``.

Starts three fronts on this machine, all on loopback:

- ``direct``: one ``ember serve``;
- ``route``: ``ember route`` with that server as its only upstream;
- ``ray``: ``ember serve --ray --replicas 1`` (a local Ray instance; Ray Serve's
  HTTP proxy, the Ember ingress deployment, one replica with its own engine).

The same requests go to each, interleaved (the order rotates every round), so
that all three see the same machine load:

1. TTFT: ``--pairs`` rounds of one stream to each front in turn, one at a
   time, with one repeated prompt (prefix-cached after the first): TTFT is as
   small as the engine can make it, and a front's share is as visible as it gets;
2. throughput: ``--rounds`` rounds of a closed loop of ``--requests`` requests
   at ``--concurrency`` streams to each front; output tokens/s over the wall time.

A front's overhead is its figure minus (or over) ``direct``'s. The Ray
replica's engine is not the direct server's: both have the same options and
threads, and only one runs at a time. On a 2-core machine the fronts' own
processes (router, Ray's proxy and ingress) share the cores with the engine,
and their CPU is part of what they cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from contextlib import AsyncExitStack, ExitStack
from datetime import datetime
from pathlib import Path

from benchmarks.servers import ServerProcess
from ember.bench.loadgen import run_closed_loop
from ember.bench.record import Clock
from ember.bench.sender import BenchError, Sender, Target
from ember.bench.workloads import story_requests

DIRECT, ROUTE, RAY = "direct", "route", "ray"
FRONTS = (DIRECT, ROUTE, RAY)
# The targets for Ray Serve's share.
RAY_TTFT_TARGET_MS = 5.0
RAY_THROUGHPUT_TARGET = 0.05


def fronts_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each engine (default %(default)s)")
    parser.add_argument("--pairs", type=int, default=30, help="TTFT rounds, one stream per front each (default %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=16, help="max_tokens of every request (default %(default)s)")
    parser.add_argument("--concurrency", type=int, default=16, help="streams in flight in the throughput rounds (default %(default)s)")
    parser.add_argument("--requests", type=int, default=32, help="requests per throughput round and front (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=2, help="throughput rounds per front (default %(default)s)")
    parser.add_argument("--out", default=None, help="result directory (default bench-results/fronts-<timestamp>)")


def run_fronts(args: argparse.Namespace) -> int:
    root = Path(args.out or f"bench-results/fronts-{datetime.now():%Y%m%d-%H%M%S}")
    root.mkdir(parents=True, exist_ok=True)
    engine_args = ("--request-timeout", "600", "--log-level", "warning")
    with ExitStack() as stack:
        direct = stack.enter_context(ServerProcess(*engine_args, threads=args.threads))
        route = ServerProcess("--upstream", direct.base, "--log-level", "warning", command="route")
        stack.callback(route.stop)
        ray = ServerProcess(*engine_args, "--ray", "--replicas", "1", threads=args.threads)
        stack.callback(ray.stop, timeout=90)
        route.wait_ready(timeout=60)
        ray.wait_ready(timeout=300)
        figures = asyncio.run(_measure({DIRECT: direct.url, ROUTE: route.url, RAY: ray.url}, args))
    report = _report(figures, args)
    print(report)
    (root / "fronts.md").write_text(report + "\n")
    config = {name: getattr(args, name) for name in ("threads", "pairs", "max_tokens", "concurrency", "requests", "rounds")}
    (root / "summary.json").write_text(json.dumps({"config": config, "figures": figures}, indent=2) + "\n")
    print(f"\nwrote {root}/: fronts.md, summary.json")
    return 0


async def _measure(urls: dict[str, str], args: argparse.Namespace) -> dict[str, dict[str, float]]:
    clock = Clock()
    async with AsyncExitStack() as stack:
        senders = {front: await stack.enter_async_context(Sender(Target(url=url), clock)) for front, url in urls.items()}
        same_prompt = story_requests(args.max_tokens, ignore_eos=True)
        for sender in senders.values():  # unrecorded: the prompt's one cold prefill, on each engine
            await sender.send(same_prompt(0), index=-1)
        ttfts: dict[str, list[float]] = {front: [] for front in FRONTS}
        for pair in range(args.pairs):
            for front in _rotated(pair):
                record = await senders[front].send(same_prompt(0), index=pair)
                if not record.ok or record.ttft_s is None:
                    raise BenchError(f"{front}: {record.error_kind}: {record.error}")
                ttfts[front].append(record.ttft_s)
        many = story_requests(args.max_tokens, ignore_eos=True)
        tokens = dict.fromkeys(FRONTS, 0)
        seconds = dict.fromkeys(FRONTS, 0.0)
        for round_index in range(args.rounds):
            for front in _rotated(round_index):
                run = await run_closed_loop(
                    senders[front].send, many, concurrency=args.concurrency, clock=clock, max_requests=args.requests
                )
                failed = [r for r in run.records if not r.ok]
                if failed:
                    raise BenchError(f"{front}: {len(failed)} requests failed, e.g. {failed[0].error_kind}: {failed[0].error}")
                tokens[front] += sum(r.output_tokens or 0 for r in run.records)
                seconds[front] += run.duration_s
    return {
        front: {"ttft_p50_s": statistics.median(ttfts[front]), "output_tokens_per_s": tokens[front] / seconds[front]} for front in FRONTS
    }


def _rotated(index: int) -> tuple[str, ...]:
    start = index % len(FRONTS)
    return FRONTS[start:] + FRONTS[:start]


def _report(figures: dict[str, dict[str, float]], args: argparse.Namespace) -> str:
    base = figures[DIRECT]
    rows = []
    for front in FRONTS:
        ttft_ms = 1000 * figures[front]["ttft_p50_s"]
        tps = figures[front]["output_tokens_per_s"]
        overhead = "" if front == DIRECT else f"{ttft_ms - 1000 * base['ttft_p50_s']:+.2f} ms"
        loss = "" if front == DIRECT else f"{100 * (1 - tps / base['output_tokens_per_s']):+.1f} %"
        rows.append(f"| {front} | {ttft_ms:.2f} | {overhead} | {tps:.1f} | {loss} |")
    ray_ms = 1000 * (figures[RAY]["ttft_p50_s"] - base["ttft_p50_s"])
    ray_loss = 1 - figures[RAY]["output_tokens_per_s"] / base["output_tokens_per_s"]
    verdict = (
        f"Ray Serve's share: {ray_ms:+.2f} ms TTFT p50 (target <= {RAY_TTFT_TARGET_MS:.0f} ms: "
        f"{'met' if ray_ms <= RAY_TTFT_TARGET_MS else 'missed'}), {100 * ray_loss:+.1f} % throughput "
        f"(target <= {100 * RAY_THROUGHPUT_TARGET:.0f} %: {'met' if ray_loss <= RAY_THROUGHPUT_TARGET else 'missed'})."
    )
    return "\n".join(
        [
            f"| front | TTFT p50 (ms), one stream | TTFT overhead | output tokens/s, {args.concurrency} streams | throughput loss |",
            "|---|---|---|---|---|",
            *rows,
            "",
            (
                f"{args.pairs} interleaved rounds of single streams with one repeated prompt (prefix-cached), then "
                f"{args.rounds} rotating rounds of {args.requests} requests at {args.concurrency} streams per front, "
                f"max_tokens {args.max_tokens}, ignore_eos, {args.threads} torch threads per engine."
            ),
            verdict,
        ]
    )
