"""``python -m benchmarks kv-cache``: the float32 KV cache (default) against the opt-in float16 one, in one run.

Two ``ember serve`` processes side by side (``make serve``'s defaults, one with
``--kv-cache-dtype float16``; both ``--kv-cache-mb 1024``, so that 16 long
conversations fit in either and the comparison is the cache's bytes, not its
capacity), driven by the front-door bench's aiohttp SSE client, and two
``LLMEngine`` instances stepped on this process's main thread (two
``AsyncEngine`` threads in one process would each open an OpenMP pool and
throttle both: engine/compute_threads.py). Each round visits all four in
turn, the order reversed every other round, so a slow stretch of this machine
falls on every column.

Workloads, 16 streams x 200 tokens at temperature 0 with ``ignore_eos`` (each
prompt cache-busted):

* **short**: the front-door bench's 16 stories (~40-token prompts);
* **long**: each stream with its own ~1,000-token prompt, the length of a
  conversation some turns in, where attention reads the most cache per step.

Figures (median of the rounds): output tok/s over the burst's wall time, the
mean of each stream's own decode rate (first to last token), and in process the
median duration of the steps where every stream decodes (no prompt chunk in
the step: the cache's effect on decode alone). The answers of
the two caches are compared token for token and the share that is identical is
printed (the float16 cache is opt-in because it may change a token;
tests/engine/test_kv_cache_dtype.py bounds the agreement).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.front_door import AiohttpFront, StreamResult
from benchmarks.servers import ServerProcess
from ember.bench.workloads import STORY_TOPICS, cache_busting_prefix, filler_text

CACHES = {"float32": "auto", "float16": "float16"}
POOL_MB = 1024
WORKLOADS = ("short", "long")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=2, help="engine threads (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each figure is their median (default %(default)s)")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=200, help="tokens per stream")
    parser.add_argument("--long-words", type=int, default=1000, help="filler words (about as many tokens) of a long prompt")
    parser.add_argument("--skip-in-process", action="store_true")
    parser.add_argument("--out", default="bench-results/kv-cache.json")


def _prompts(workload: str, streams: int, long_words: int, rng: random.Random) -> list[list[dict[str, str]]]:
    """The burst's messages: the same for both caches within a round, so their answers can be compared."""
    prompts = []
    for i in range(streams):
        topic = STORY_TOPICS[i % len(STORY_TOPICS)]
        prefix = cache_busting_prefix(rng)
        if workload == "long":
            text = f"{prefix} Notes: {filler_text(long_words, rng)}\nNow write a long story about {topic}."
        else:
            text = f"{prefix} Write a long story about {topic}."
        prompts.append([{"role": "user", "content": text}])
    return prompts


def _engine_burst(engine: Any, prompts: list[list[dict[str, str]]], tokens: int) -> tuple[list[StreamResult], float, float]:
    """The burst on an ``LLMEngine``, stepped here until every request finished: a StreamResult each, the
    wall time, and the median duration of the steps that only decode (every prompt done, none finished)."""
    from ember.engine.sampling import SamplingParams

    started = time.perf_counter()
    ids = [engine.tokenizer.encode_chat(p) for p in prompts]
    for i, prompt in enumerate(ids):
        engine.add_request(f"kv-{i}", prompt, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    counts: dict[str, int] = {}
    texts: dict[str, list[str]] = {}
    decode_steps: list[float] = []
    while engine.has_unfinished():
        all_decoding = len(first) == len(ids)
        before = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        if all_decoding and len(outputs) == len(ids) and not any(out.finished for out in outputs):
            decode_steps.append(now - before)
        for out in outputs:
            if out.new_token_ids:
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
                counts[out.request_id] = counts.get(out.request_id, 0) + len(out.new_token_ids)
            texts.setdefault(out.request_id, []).append(out.text_delta)
    end = time.perf_counter()
    results = []
    for i, prompt in enumerate(ids):
        r = f"kv-{i}"
        results.append(StreamResult(first[r] - started, end - started, counts[r], last[r] - first[r], len(prompt), 0, "".join(texts[r])))
    return results, end - started, statistics.median(decode_steps) if decode_steps else float("nan")


async def _burst(front: Any, prompts: list[list[dict[str, str]]], tokens: int) -> tuple[dict[str, float], list[str]]:
    if isinstance(front, AiohttpFront):
        started = time.perf_counter()
        results: list[StreamResult] = await asyncio.gather(*(front.chat(p, max_tokens=tokens, ignore_eos=True) for p in prompts))
        wall = time.perf_counter() - started
        step_s = float("nan")  # not visible through HTTP
    else:
        results, wall, step_s = _engine_burst(front, prompts, tokens)
    figures = {
        "output_tps": sum(r.tokens for r in results) / wall,
        "stream_decode_tps": statistics.fmean(r.decode_tps for r in results),
        "prompt_tokens": statistics.fmean(r.prompt_tokens for r in results),
        "decode_step_ms": 1e3 * step_s,
    }
    return figures, [r.text for r in results]


async def _measure(args: argparse.Namespace, urls: dict[str, str]) -> tuple[dict[str, dict[str, list[dict[str, float]]]], dict[str, float]]:
    from ember.config import EngineConfig
    from ember.engine.engine import LLMEngine
    from ember.model.loader import load_model

    fronts: dict[str, Any] = {f"HTTP, {cache}": AiohttpFront(url) for cache, url in urls.items()}
    if not args.skip_in_process:
        loaded = load_model(None)
        for cache, dtype in CACHES.items():
            config = EngineConfig(threads=args.threads, kv_cache_bytes=POOL_MB << 20, kv_cache_dtype=dtype)
            fronts[f"in process, {cache}"] = LLMEngine(None, config, loaded=loaded)
    runs: dict[str, dict[str, list[dict[str, float]]]] = {name: {w: [] for w in WORKLOADS} for name in fronts}
    same: dict[str, list[float]] = {w: [] for w in WORKLOADS}
    try:
        # Warm-up: a first burst pays for allocations and lazy initialisation (measured: 0.65x).
        warm = _prompts("short", args.streams, args.long_words, random.Random(-1))
        for front in fronts.values():
            await _burst(front, warm, 8)
        for index in range(args.rounds):
            rng = random.Random(index)
            order = list(fronts) if index % 2 == 0 else list(reversed(fronts))
            for workload in WORKLOADS:
                prompts = _prompts(workload, args.streams, args.long_words, rng)
                texts: dict[str, list[str]] = {}
                for name in order:
                    figures, texts[name] = await _burst(fronts[name], prompts, args.tokens)
                    runs[name][workload].append(figures)
                    print(f"round {index} {workload:5} {name:20} {figures['output_tps']:7.1f} tok/s", flush=True)
                for where in ("HTTP", "in process"):
                    a, b = texts.get(f"{where}, float32"), texts.get(f"{where}, float16")
                    if a is not None and b is not None:
                        same[workload].append(sum(x == y for x, y in zip(a, b, strict=True)) / len(a))
    finally:
        for front in fronts.values():
            if isinstance(front, AiohttpFront):
                await front.close()
    return runs, {w: statistics.fmean(v) for w, v in same.items() if v}


def main(args: argparse.Namespace) -> int:
    servers = {
        cache: ServerProcess("--kv-cache-dtype", dtype, "--kv-cache-mb", str(POOL_MB), "--request-timeout", "600", threads=args.threads)
        for cache, dtype in CACHES.items()
    }
    try:
        for server in servers.values():
            server.wait_ready()
        runs, same = asyncio.run(_measure(args, {cache: server.url for cache, server in servers.items()}))
    finally:
        for server in servers.values():
            server.stop()
    median = {
        name: {w: {k: statistics.median(r[k] for r in rounds) for k in rounds[0]} for w, rounds in by.items()} for name, by in runs.items()
    }
    print(f"\nKV cache float32 vs float16: {args.streams} streams x {args.tokens} tokens, greedy, median of {args.rounds} rounds")
    print(
        "| workload | path | prompt tokens | float32 tok/s | float16 tok/s | float16 / float32 | per-stream decode tok/s, float32 -> float16 "
        "| decode-only step ms, float32 -> float16 |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for workload in WORKLOADS:
        for where in ("HTTP", "in process"):
            if f"{where}, float32" not in median:
                continue
            a, b = median[f"{where}, float32"][workload], median[f"{where}, float16"][workload]
            print(
                f"| {workload} | {where} | {a['prompt_tokens']:.0f} | {a['output_tps']:.1f} | {b['output_tps']:.1f} | "
                f"**{b['output_tps'] / a['output_tps']:.2f}x** | {a['stream_decode_tps']:.1f} -> {b['stream_decode_tps']:.1f} | "
                + (f"{a['decode_step_ms']:.1f} -> {b['decode_step_ms']:.1f} |" if where == "in process" else "not visible |")
            )
    for workload, share in same.items():
        print(f"answers identical between the caches, {workload}: {share:.0%} of streams")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rounds": runs, "median": median, "identical_share": same}, indent=1))
    return 0
