"""The HTTP workloads: what each ``ember bench <workload>`` runs and what it reports.

Each ``run_*`` coroutine takes a ``BenchContext`` (the sender, clock, SLO,
seed and progress bar shared by every workload) plus its own parameters, and
returns a ``BenchResult`` for ``report.py`` to write. The max-tokens
experiment lives in ``maxtokens.py``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from ember.bench.loadgen import RunResult, run_closed_loop, run_conversations, run_open_loop
from ember.bench.metrics import SLO, describe, stats_by
from ember.bench.progress import BenchProgress
from ember.bench.record import Clock, RequestRecord
from ember.bench.report import fmt_ms, fmt_number, fmt_percent, markdown_table
from ember.bench.result import BenchResult, Section, make_group
from ember.bench.sender import Sender
from ember.bench.workloads import Conversation, SpecFactory, prefill_requests, story_requests


@dataclass
class BenchContext:
    """What every workload shares for one run.

    ``ignore_eos`` is the user's choice; None means "auto": send it only to a
    server known to understand it (Ember, seen from its reply header during
    warm-up), since other OpenAI-compatible servers may reject unknown fields.
    """

    sender: Sender
    clock: Clock
    slo: SLO
    seed: int
    progress: BenchProgress
    ignore_eos: bool | None = None

    def use_ignore_eos(self) -> bool:
        return self.sender.server_is_ember if self.ignore_eos is None else self.ignore_eos

    def config(self, **workload_options: Any) -> dict[str, Any]:
        """The run's configuration as saved in summary.json and shown in the report."""
        target = self.sender.target
        return {
            "url": target.url,
            "model": self.sender.model,
            "server_is_ember": self.sender.server_is_ember,
            "http2": target.speaks_http2,
            "transport": target.transport,
            "new_connection_per_request": target.new_connection_per_request,
            "seed": self.seed,
            **workload_options,
        }

    async def run_load(
        self,
        description: str,
        make_spec: SpecFactory,
        *,
        concurrency: int = 1,
        rate: float | None = None,
        requests: int | None = None,
        duration_s: float | None = None,
    ) -> RunResult:
        """Closed loop at ``concurrency``, or open loop (Poisson) when ``rate`` is given."""
        self.progress.phase(description, requests)
        send, on_record = self.sender.send, self.progress.on_record
        if rate is not None:
            return await run_open_loop(
                send,
                make_spec,
                rate=rate,
                seed=self.seed,
                clock=self.clock,
                max_requests=requests,
                duration_s=duration_s,
                on_record=on_record,
            )
        return await run_closed_loop(
            send,
            make_spec,
            concurrency=concurrency,
            clock=self.clock,
            max_requests=requests,
            duration_s=duration_s,
            on_record=on_record,
        )


def load_shape(concurrency: int, rate: float | None, requests: int | None, duration_s: float | None) -> dict[str, Any]:
    """The load-shape part of a group's parameters."""
    shape: dict[str, Any] = {"loop": "open" if rate is not None else "closed"}
    shape.update({"rate": rate} if rate is not None else {"concurrency": concurrency})
    return {**shape, "requests": requests, "duration_s": duration_s}


async def run_single(ctx: BenchContext, *, max_tokens: int, requests: int | None, duration_s: float | None) -> BenchResult:
    """One stream at a time: TTFT and the decode speed of a lone request (1 / TPOT)."""
    ignore_eos = ctx.use_ignore_eos()
    make = story_requests(max_tokens, ignore_eos=ignore_eos)
    run = await ctx.run_load("single", make, requests=requests, duration_s=duration_s)
    group = make_group("single", {"max_tokens": max_tokens, **load_shape(1, None, requests, duration_s)}, run, ctx.slo)
    decode = describe(1.0 / r.tpot_s for r in group.records if r.tpot_s)
    s = group.summary
    table = markdown_table(
        ["metric", "mean", "p50", "p90", "p99"],
        [
            ["TTFT (ms)", fmt_ms(s.ttft.mean), fmt_ms(s.ttft.p50), fmt_ms(s.ttft.p90), fmt_ms(s.ttft.p99)],
            ["decode tokens/s per stream", *(fmt_number(v, 1) for v in (decode.mean, decode.p50, decode.p90, decode.p99))],
        ],
    )
    note = "Decode tokens/s of a request is 1 / TPOT: output tokens after the first, divided by the time after the first."
    return BenchResult(
        "single",
        ctx.config(max_tokens=max_tokens, ignore_eos=ignore_eos),
        [group],
        ctx.slo,
        sections=[Section("Single stream", f"{table}\n\n{note}")],
        extras={"decode_tokens_per_s": decode.to_dict()},
    )


async def run_prefill(
    ctx: BenchContext, *, prompt_words: int, concurrency: int, rate: float | None, requests: int | None, duration_s: float | None
) -> BenchResult:
    """Long cache-busted prompts with max_tokens=1: TTFT is queueing plus prefill."""
    make = prefill_requests(prompt_words, ctx.seed)
    run = await ctx.run_load("prefill", make, concurrency=concurrency, rate=rate, requests=requests, duration_s=duration_s)
    params = {"prompt_words": prompt_words, **load_shape(concurrency, rate, requests, duration_s)}
    group = make_group("prefill", params, run, ctx.slo)
    done = [r for r in group.records if r.ok and r.ttft_s]
    speed = describe((r.prompt_tokens or 0) / r.ttft_s for r in done if r.ttft_s)
    prompt = describe(r.prompt_tokens for r in done if r.prompt_tokens is not None)
    cached = describe(r.cached_tokens for r in done if r.cached_tokens is not None)
    table = markdown_table(
        ["prompt tokens (mean)", "cached tokens (mean)", "TTFT p50 (ms)", "prefill tokens/s (mean)", "prefill tokens/s (p50)"],
        [
            [
                fmt_number(prompt.mean, 0),
                fmt_number(cached.mean, 1),
                fmt_ms(group.summary.ttft.p50),
                fmt_number(speed.mean, 0),
                fmt_number(speed.p50, 0),
            ]
        ],
    )
    note = (
        "Every prompt starts with a unique line, so no prefix cache can serve it (the cached-token column, "
        "from the server's usage, shows what was reused anyway, e.g. a shared chat-template header). "
        "Prefill tokens/s = prompt tokens / TTFT, so it includes queueing and the network."
    )
    return BenchResult(
        "prefill",
        ctx.config(**params),
        [group],
        ctx.slo,
        sections=[Section("Prefill", f"{table}\n\n{note}")],
        extras={"prefill_tokens_per_s": speed.to_dict(), "cached_tokens": cached.to_dict()},
    )


async def run_load_test(
    ctx: BenchContext, *, max_tokens: int, concurrency: int, rate: float | None, requests: int | None, duration_s: float | None
) -> BenchResult:
    """Story requests under a closed-loop or open-loop (Poisson) load."""
    ignore_eos = ctx.use_ignore_eos()
    make = story_requests(max_tokens, ignore_eos=ignore_eos)
    run = await ctx.run_load("load", make, concurrency=concurrency, rate=rate, requests=requests, duration_s=duration_s)
    params = {"max_tokens": max_tokens, **load_shape(concurrency, rate, requests, duration_s)}
    group = make_group("load", params, run, ctx.slo)
    sections = []
    if rate is not None:
        lag = describe(r.start_s - r.scheduled_s for r in group.records)
        sections.append(
            Section(
                "Open loop",
                f"Poisson arrivals at {rate:g} requests/s (seed {ctx.seed}). Client send lag behind schedule: "
                f"mean {fmt_ms(lag.mean)} ms, p99 {fmt_ms(lag.p99)} ms (near 0 means the client kept up).",
            )
        )
    return BenchResult("load", ctx.config(ignore_eos=ignore_eos, **params), [group], ctx.slo, sections=sections)


async def run_sweep(
    ctx: BenchContext,
    *,
    concurrencies: list[int],
    max_tokens_list: list[int],
    requests_per_point: int | None,
    duration_per_point_s: float | None,
) -> BenchResult:
    """A closed-loop grid: every concurrency × every max_tokens.

    Without ``requests_per_point`` or a duration a point runs 4 × concurrency
    requests, so every worker sends a few and the pipeline fills up.
    """
    ignore_eos = ctx.use_ignore_eos()
    groups = []
    for max_tokens in max_tokens_list:
        for concurrency in concurrencies:
            count = requests_per_point
            if count is None and duration_per_point_s is None:
                count = 4 * concurrency
            label = f"c={concurrency} max_tokens={max_tokens}"
            make = story_requests(max_tokens, ignore_eos=ignore_eos, group=label)
            run = await ctx.run_load(label, make, concurrency=concurrency, requests=count, duration_s=duration_per_point_s)
            groups.append(make_group(label, {"concurrency": concurrency, "max_tokens": max_tokens, "requests": count}, run, ctx.slo))
    config = ctx.config(
        concurrency=concurrencies,
        max_tokens=max_tokens_list,
        requests_per_point=requests_per_point,
        duration_per_point_s=duration_per_point_s,
        ignore_eos=ignore_eos,
    )
    return BenchResult("sweep", config, groups, ctx.slo, plots=["latency_cdf", "throughput_vs_concurrency", "latency_vs_max_tokens"])


async def run_multiturn(
    ctx: BenchContext, *, conversations: int, turns: int, system_words: int, max_tokens: int, think_time_s: float
) -> BenchResult:
    """N concurrent conversations × T turns with growing history and session ids."""
    ignore_eos = bool(ctx.ignore_eos)  # natural replies unless asked: a chat is not a fixed-length job
    run_id = uuid.uuid4().hex[:8]
    chats = [Conversation(i, system_words=system_words, seed=ctx.seed, run_id=run_id) for i in range(conversations)]
    ctx.progress.phase("multiturn", conversations * turns)
    run = await run_conversations(
        ctx.sender.send,
        chats,
        turns=turns,
        max_tokens=max_tokens,
        clock=ctx.clock,
        ignore_eos=ignore_eos,
        think_time_s=think_time_s,
        group="multiturn",
        on_record=ctx.progress.on_record,
    )
    params = {
        "conversations": conversations,
        "turns": turns,
        "system_words": system_words,
        "max_tokens": max_tokens,
        "think_time_s": think_time_s,
    }
    group = make_group("multiturn", params, run, ctx.slo)
    ttft = stats_by(group.records, lambda r: r.turn, lambda r: r.ttft_s)
    prompt = stats_by(group.records, lambda r: r.turn, lambda r: r.prompt_tokens)
    cached = stats_by(group.records, lambda r: r.turn, lambda r: r.cached_tokens)
    rows = [
        [
            str(turn),
            str(stats.count),
            fmt_number(prompt[turn].mean if turn in prompt else None, 0),
            fmt_number(cached[turn].mean if turn in cached else None, 0),
            fmt_ms(stats.mean),
            fmt_ms(stats.p50),
            fmt_ms(stats.p99),
        ]
        for turn, stats in ttft.items()
    ]
    table = markdown_table(["turn", "requests", "prompt tokens", "cached tokens", "TTFT mean (ms)", "TTFT p50 (ms)", "TTFT p99 (ms)"], rows)
    note = (
        "Each turn resends the whole history (system prompt, earlier questions and replies) with the "
        "conversation's `X-Session-ID`. A server that keeps the conversation's KV cache answers later turns "
        "with a TTFT close to turn 1's although the prompt grows; cached tokens come from the server's usage."
    )
    return BenchResult(
        "multiturn",
        ctx.config(ignore_eos=ignore_eos, **params),
        [group],
        ctx.slo,
        plots=["latency_cdf", "ttft_by_turn"],
        sections=[Section("TTFT by turn", f"{table}\n\n{note}")],
        extras={"ttft_by_turn": {str(turn): stats.to_dict() for turn, stats in ttft.items()}},
    )


async def run_stream_vs_full(ctx: BenchContext, *, pairs: int, max_tokens: int) -> BenchResult:
    """Perceived latency: first visible text when streaming vs the whole reply without streaming.

    Each pair sends the same prompt twice, one request at a time, alternating
    which mode goes first so that neither always profits from a warm cache.
    """
    ignore_eos = ctx.use_ignore_eos()
    makers = {
        "stream": story_requests(max_tokens, ignore_eos=ignore_eos, group="stream"),
        "full": story_requests(max_tokens, ignore_eos=ignore_eos, stream=False, group="full"),
    }
    ctx.progress.phase("stream-vs-full", 2 * pairs)
    by_mode: dict[str, list[RequestRecord]] = {"stream": [], "full": []}
    for pair in range(pairs):
        order = ["stream", "full"] if pair % 2 == 0 else ["full", "stream"]
        for mode in order:
            record = await ctx.sender.send(makers[mode](pair), index=2 * pair + (mode == "full"))
            by_mode[mode].append(record)
            ctx.progress.on_record(record)
    groups = []
    for mode, records in by_mode.items():
        run = RunResult(records, min(r.start_s for r in records), max(r.end_s or r.start_s for r in records))
        groups.append(make_group(mode, {"stream": mode == "stream", "max_tokens": max_tokens, "pairs": pairs}, run, ctx.slo))
    stream_summary, full_summary = groups[0].summary, groups[1].summary
    first_text = stream_summary.ttft.mean
    stream_total, full_total = stream_summary.e2e.mean, full_summary.e2e.mean
    cut = None if first_text is None or not full_total else 1.0 - first_text / full_total
    table = markdown_table(
        ["mode", "first visible text (ms)", "whole reply (ms)"],
        [["streaming", fmt_ms(first_text), fmt_ms(stream_total)], ["non-streaming", fmt_ms(full_total), fmt_ms(full_total)]],
    )
    verdict = (
        f"Streaming cuts the perceived latency (time until the user sees text) by **{fmt_percent(cut)}** "
        f"(1 − first text streamed / whole reply non-streamed, means over {pairs} pairs at max_tokens {max_tokens}). "
        "The design claims about 60 %; the cut grows with the reply length, since the first text does not wait for the rest."
    )
    return BenchResult(
        "stream-vs-full",
        ctx.config(pairs=pairs, max_tokens=max_tokens, ignore_eos=ignore_eos),
        groups,
        ctx.slo,
        plots=["latency_cdf", "perceived_latency"],
        sections=[Section("Streaming vs waiting for the whole reply", f"{table}\n\n{verdict}")],
        extras={"first_text_s": first_text, "stream_total_s": stream_total, "full_total_s": full_total, "perceived_latency_cut": cut},
    )
