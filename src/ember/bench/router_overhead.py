"""``ember bench router-overhead``: what a router adds, measured against the replica behind it.

``--url`` is the router, ``--direct-url`` one replica behind it (ideally its
only upstream). Both get the same requests, interleaved, so that both see the
same machine load, which matters on a shared machine:

1. TTFT: ``--pairs`` single streams to each, one at a time, alternating which
   goes first. Every request has the same prompt, so after the first one it is
   a prefix-cache hit and TTFT is as small as the replica can make it: the
   router's share is as visible as it gets.
2. Throughput: ``--rounds`` closed-loop runs at ``--concurrency`` streams to
   each, alternating which goes first; output tokens/s over the rounds' wall time.
"""

from __future__ import annotations

import statistics

from ember.bench.experiments import BenchContext
from ember.bench.loadgen import RunResult, run_closed_loop
from ember.bench.record import RequestRecord
from ember.bench.report import fmt_ms, fmt_number, fmt_percent, markdown_table
from ember.bench.result import BenchResult, Group, Section, make_group
from ember.bench.sender import BenchError, Sender
from ember.bench.workloads import story_requests

ROUTED, DIRECT = "routed", "direct"


async def run_router_overhead(
    ctx: BenchContext, direct: Sender, *, pairs: int, max_tokens: int, concurrency: int, requests: int, rounds: int
) -> BenchResult:
    """TTFT p50 and output tokens/s through the router (``ctx.sender``) and straight to ``direct``."""
    ignore_eos = ctx.use_ignore_eos()
    senders = {ROUTED: ctx.sender, DIRECT: direct}

    # 1. Time to first token, one request at a time.
    same_prompt = story_requests(max_tokens, ignore_eos=ignore_eos)
    # Unrecorded: the one cold prefill of the prompt must not land on either path.
    await direct.send(same_prompt(0), index=-1)
    ctx.progress.phase("ttft pairs", 2 * pairs)
    ttft_records: dict[str, list[RequestRecord]] = {ROUTED: [], DIRECT: []}
    for pair in range(pairs):
        for path in (ROUTED, DIRECT) if pair % 2 == 0 else (DIRECT, ROUTED):
            record = await senders[path].send(same_prompt(0), index=len(ttft_records[path]))
            ttft_records[path].append(record)
            ctx.progress.on_record(record)

    # 2. Output tokens/s at ``concurrency`` streams.
    many = story_requests(max_tokens, ignore_eos=ignore_eos)
    load_runs: dict[str, list[RunResult]] = {ROUTED: [], DIRECT: []}
    ctx.progress.phase("throughput rounds", 2 * rounds * requests)
    for round_index in range(rounds):
        for path in (DIRECT, ROUTED) if round_index % 2 == 0 else (ROUTED, DIRECT):
            run = await run_closed_loop(
                senders[path].send,
                many,
                concurrency=concurrency,
                clock=ctx.clock,
                max_requests=requests,
                on_record=ctx.progress.on_record,
            )
            load_runs[path].append(run)

    failed = [r for records in ttft_records.values() for r in records if not r.ok]
    failed += [r for runs in load_runs.values() for run in runs for r in run.records if not r.ok]
    if failed:
        raise BenchError(f"{len(failed)} requests failed, e.g. {failed[0].error_kind}: {failed[0].error}")

    groups: list[Group] = []
    ttft_p50: dict[str, float] = {}
    for path, records in ttft_records.items():
        ttft_p50[path] = statistics.median(r.ttft_s for r in records if r.ttft_s is not None)
        run = RunResult(records, records[0].start_s, max(r.end_s or r.start_s for r in records))
        params = {"path": path, "max_tokens": max_tokens, "concurrency": 1}
        groups.append(make_group(f"ttft-{path}", params, run, ctx.slo))
    tokens_per_s: dict[str, float] = {}
    for path, runs in load_runs.items():
        output_tokens = sum(r.output_tokens or 0 for run in runs for r in run.records)
        tokens_per_s[path] = output_tokens / sum(run.duration_s for run in runs)
        for i, run in enumerate(runs):
            params = {"path": path, "max_tokens": max_tokens, "concurrency": concurrency, "round": i + 1}
            groups.append(make_group(f"load-{path}-{i + 1}", params, run, ctx.slo))

    overhead_s = ttft_p50[ROUTED] - ttft_p50[DIRECT]
    loss = 1.0 - tokens_per_s[ROUTED] / tokens_per_s[DIRECT]
    table = markdown_table(
        ["metric", "direct", "routed", "router's share"],
        [
            ["TTFT p50 (ms), one stream", fmt_ms(ttft_p50[DIRECT]), fmt_ms(ttft_p50[ROUTED]), f"{overhead_s * 1000:+.2f} ms"],
            [
                f"output tokens/s, {concurrency} streams",
                fmt_number(tokens_per_s[DIRECT], 1),
                fmt_number(tokens_per_s[ROUTED], 1),
                f"{fmt_percent(loss)} loss",
            ],
        ],
    )
    note = (
        f"{pairs} interleaved pairs of single streams with one repeated prompt (prefix-cached), then {rounds} "
        f"alternating rounds of {requests} requests at {concurrency} streams each, max_tokens {max_tokens}. "
        "On a machine where the router shares CPU cores with the replica, the throughput loss includes "
        "the cores the router takes from the replica."
    )
    return BenchResult(
        "router-overhead",
        ctx.config(
            direct_url=direct.target.url,
            pairs=pairs,
            max_tokens=max_tokens,
            concurrency=concurrency,
            requests=requests,
            rounds=rounds,
            ignore_eos=ignore_eos,
        ),
        groups,
        ctx.slo,
        sections=[Section("Router overhead", f"{table}\n\n{note}")],
        extras={
            "ttft_p50_s": ttft_p50,
            "ttft_overhead_s": overhead_s,
            "output_tokens_per_s": tokens_per_s,
            "throughput_loss": loss,
        },
    )
