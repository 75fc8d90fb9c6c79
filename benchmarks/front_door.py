"""``python -m benchmarks front-door``: what a user gets through ``make serve``, next to the engine in process.

One run measures the same workloads in each of these ways and prints them side by side
with the ratio HTTP / in process (in process and HTTP take turns, ``--rounds``
times, and each figure is the median of its rounds):

* **in process**: ``AsyncEngine.for_model`` in this process, the arrangement
  the server uses (the engine built and stepped on its own thread), driven
  from an asyncio loop exactly as the server's routes drive it (chat template,
  session prompt ids), without HTTP;
* **HTTP**: ``ember serve`` with ``make serve``'s defaults in a subprocess,
  driven over loopback with SSE streaming by each of two clients in turn
  (``--clients``): aiohttp, as vLLM's serving benchmark drives a server, and
  httpx, this bench's load generator before; on two cores the client's own
  CPU slows the server it measures (``HTTPFront``);
* **previous kernels** (unless ``--skip-previous``): the same in-process engine
  with the kernels' previous default switched on for its own visit each round
  (``PREVIOUS_KERNELS``, the engine bench's ``kernel_path``);
* **previous arrangement** (single-stream decode and 16 streams only): the
  engine built on this thread and stepped on another, which is what the
  server did before ``engine/compute_threads.py`` (2x slower decode).

Workloads (prompts are cache-busted unless the figure is about caching):
single-stream decode and end to end (story prompt, 200 tokens, ignore_eos,
temperature 0), TTFT of a short (~40-token) chat prompt, 50-token answers
back to back (QPS), 16 concurrent streams x 200 tokens (output tok/s, TTFT
mean; then again at temperature 0.7 / top_p 0.9 with a seed per stream, and
its ratio to greedy on the same front: issue 12's sampled target), 1,000-token
cold prefill (prompt tokens / TTFT), and 4 conversations x 6 turns in
parallel over a shared 273-token system prompt (max_tokens 64, TTFT mean).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from benchmarks.servers import ServerProcess
from ember.bench.workloads import FOLLOW_UPS, STORY_TOPICS, cache_busting_prefix, filler_text

STORY = [{"role": "user", "content": "Write a long story about a dragon who learns to cook."}]


@dataclass
class StreamResult:
    """One streamed chat completion as its caller saw it (seconds from the request)."""

    ttft_s: float
    e2e_s: float
    tokens: int
    decode_s: float  # first to last token
    prompt_tokens: int
    cached_tokens: int
    text: str

    @property
    def decode_tps(self) -> float:
        return (self.tokens - 1) / self.decode_s if self.tokens > 1 and self.decode_s > 0 else float("nan")


@dataclass(frozen=True)
class Sampling:
    """How a request samples: greedy unless said otherwise."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None


GREEDY = Sampling()


class Front(Protocol):
    """A way to reach the engine: in process or through the server."""

    async def chat(
        self,
        messages: list[dict[str, str]],
        *,
        max_tokens: int,
        ignore_eos: bool = False,
        session_id: str | None = None,
        sampling: Sampling = GREEDY,
    ) -> StreamResult: ...


class InProcessFront:
    """An ``AsyncEngine`` driven the way ``server/generation.py`` drives it (no HTTP, no admission)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._ids = 0

    async def chat(
        self,
        messages: list[dict[str, str]],
        *,
        max_tokens: int,
        ignore_eos: bool = False,
        session_id: str | None = None,
        sampling: Sampling = GREEDY,
    ) -> StreamResult:
        from ember.engine.api import SamplingParams

        started = time.perf_counter()
        tokenizer = self.engine.tokenizer
        rendered = tokenizer.render_chat(messages)
        prompt = None
        if session_id is not None:
            prompt = self.engine.session_prompt_ids(session_id, rendered, lambda text: tokenizer.encode(text, add_bos=False))
        if prompt is None:
            prompt = tokenizer.encode_rendered(rendered)
        self._ids += 1
        params = SamplingParams(
            max_tokens=max_tokens, temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed, ignore_eos=ignore_eos
        )
        first = last = None
        tokens, cached, text = 0, 0, []
        async for out in self.engine.generate(f"fd-{self._ids}", prompt, params, session_id=session_id):
            if out.new_token_ids:
                last = time.perf_counter()
                first = first or last
                tokens += len(out.new_token_ids)
            text.append(out.text_delta)
            cached = out.num_cached_tokens
        end = time.perf_counter()
        assert first is not None and last is not None
        return StreamResult(first - started, end - started, tokens, last - first, len(prompt), cached, "".join(text))


class HTTPFront:
    """The OpenAI chat completions API with SSE streaming over loopback; subclasses bring the HTTP client.

    The load generator shares the server's two cores, and every CPU second it
    spends preempts one of the engine's two compute threads (whose partner then
    waits at the step's barrier), so its cost shows up doubled in the server's
    figures. The bench therefore measures with two clients in the same run:
    aiohttp, the load generator of vLLM's serving benchmark (about a third of
    httpx's CPU per streamed token, measured here), and httpx, this bench's
    previous one.
    """

    name = ""

    def __init__(self, url: str) -> None:
        self.url = url

    def _lines(self, body: dict[str, Any], headers: dict[str, str]) -> AsyncIterator[str]:
        """The response's lines (SSE), raising on an HTTP error status."""
        raise NotImplementedError

    async def chat(
        self,
        messages: list[dict[str, str]],
        *,
        max_tokens: int,
        ignore_eos: bool = False,
        session_id: str | None = None,
        sampling: Sampling = GREEDY,
    ) -> StreamResult:
        body: dict[str, Any] = {
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "ignore_eos": ignore_eos,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        headers = {"X-Session-ID": session_id} if session_id else {}
        started = time.perf_counter()
        first = last = None
        usage: dict[str, Any] = {}
        text = []
        async for line in self._lines(body, headers):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", ()):
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    last = time.perf_counter()
                    first = first or last
                    text.append(piece)
        end = time.perf_counter()
        assert first is not None and last is not None, "the stream carried no text"
        details = usage.get("prompt_tokens_details") or {}
        return StreamResult(
            first - started,
            end - started,
            usage.get("completion_tokens", 0),
            last - first,
            usage.get("prompt_tokens", 0),
            details.get("cached_tokens", 0),
            "".join(text),
        )

    async def close(self) -> None:
        raise NotImplementedError


class AiohttpFront(HTTPFront):
    """One keep-alive aiohttp session."""

    name = "aiohttp"

    def __init__(self, url: str) -> None:
        import aiohttp

        super().__init__(url)
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600), connector=aiohttp.TCPConnector(limit=64))

    async def _lines(self, body: dict[str, Any], headers: dict[str, str]) -> AsyncIterator[str]:
        async with self.session.post(f"{self.url}/chat/completions", json=body, headers=headers) as response:
            response.raise_for_status()
            async for raw in response.content:
                yield raw.decode().rstrip("\r\n")

    async def close(self) -> None:
        await self.session.close()


class HttpxFront(HTTPFront):
    """One keep-alive httpx client (the previous load generator)."""

    name = "httpx"

    def __init__(self, url: str) -> None:
        import httpx

        super().__init__(url)
        self.client = httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64, max_keepalive_connections=64))

    async def _lines(self, body: dict[str, Any], headers: dict[str, str]) -> AsyncIterator[str]:
        async with self.client.stream("POST", f"{self.url}/chat/completions", json=body, headers=headers) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                yield line

    async def close(self) -> None:
        await self.client.aclose()


CLIENTS: dict[str, type[HTTPFront]] = {"aiohttp": AiohttpFront, "httpx": HttpxFront}
# The kernels' previous default (a key of the engine bench's KERNEL_PATHS), measured in process next to the default.
PREVIOUS_KERNELS = "amx-gather-first"


# ---------------------------------------------------------------------------
# The workloads: each returns named figures
# ---------------------------------------------------------------------------


def _short_prompt(rng: random.Random) -> list[dict[str, str]]:
    """~40 tokens: a unique first line (no prefix-cache hit) and a short question."""
    return [
        {"role": "user", "content": f"{cache_busting_prefix(rng)} {filler_text(8, rng)} What is the capital of France? Answer briefly."}
    ]


@dataclass
class Figures:
    values: dict[str, float] = field(default_factory=dict)

    def put(self, name: str, value: float) -> None:
        self.values[name] = value


async def single_stream(front: Front, figures: Figures, runs: int) -> None:
    results = [await front.chat(STORY, max_tokens=200, ignore_eos=True) for _ in range(runs + 1)][1:]  # the first warms up
    figures.put("decode_tps", statistics.median(r.decode_tps for r in results))
    figures.put("e2e_200_s", statistics.median(r.e2e_s for r in results))


async def short_ttft(front: Front, figures: Figures, requests: int, rng: random.Random) -> None:
    results = [await front.chat(_short_prompt(rng), max_tokens=1) for _ in range(requests)]
    figures.put("ttft_short_p50_s", statistics.median(r.ttft_s for r in results))
    figures.put("short_prompt_tokens", statistics.median(r.prompt_tokens for r in results))


async def back_to_back(front: Front, figures: Figures, requests: int, rng: random.Random) -> None:
    started = time.perf_counter()
    for _ in range(requests):
        await front.chat(_short_prompt(rng), max_tokens=50, ignore_eos=True)
    figures.put("qps_50", requests / (time.perf_counter() - started))


# What chat clients send (issue 12's sampled workload); stream i is seeded with i.
CHAT_SAMPLING = Sampling(temperature=0.7, top_p=0.9)


async def concurrent_streams(front: Front, figures: Figures, streams: int, rng: random.Random, *, sampled: bool = False) -> None:
    """16 stories at once; greedy, or (``sampled``) at CHAT_SAMPLING with a seed per stream."""
    prompts = [
        [{"role": "user", "content": f"{cache_busting_prefix(rng)} Write a long story about {STORY_TOPICS[i % len(STORY_TOPICS)]}."}]
        for i in range(streams)
    ]
    samplings = [replace(CHAT_SAMPLING, seed=i) if sampled else GREEDY for i in range(streams)]
    started = time.perf_counter()
    results = await asyncio.gather(
        *(front.chat(p, max_tokens=200, ignore_eos=True, sampling=s) for p, s in zip(prompts, samplings, strict=True))
    )
    wall = time.perf_counter() - started
    tps = sum(r.tokens for r in results) / wall
    if sampled:
        figures.put("streams16_sampled_tps", tps)
        return
    figures.put("streams16_tps", tps)
    figures.put("streams16_ttft_mean_s", statistics.fmean(r.ttft_s for r in results))


async def cold_prefill(front: Front, figures: Figures, runs: int, rng: random.Random) -> None:
    rates = []
    for _ in range(runs):
        text = f"{cache_busting_prefix(rng)} {filler_text(960, rng)}\nSay OK."
        r = await front.chat([{"role": "user", "content": text}], max_tokens=1)
        rates.append(r.prompt_tokens / r.ttft_s)
    figures.put("prefill_tps", statistics.median(rates))


async def multiturn(front: Front, figures: Figures, conversations: int, turns: int, rng: random.Random) -> None:
    system = f"{cache_busting_prefix(rng)} You are a helpful assistant. Background notes: {filler_text(250, rng)}"
    run = f"{rng.getrandbits(32):08x}"

    async def conversation(c: int) -> list[float]:
        messages = [{"role": "system", "content": system}]
        ttfts = []
        for turn in range(turns):
            question = f"Tell me about {STORY_TOPICS[c % len(STORY_TOPICS)]}." if turn == 0 else FOLLOW_UPS[(c + turn) % len(FOLLOW_UPS)]
            messages.append({"role": "user", "content": question})
            r = await front.chat(list(messages), max_tokens=64, session_id=f"fd-{run}-{c}")
            messages.append({"role": "assistant", "content": r.text})
            ttfts.append(r.ttft_s)
        return ttfts

    by_conversation = await asyncio.gather(*(conversation(c) for c in range(conversations)))
    figures.put("multiturn_ttft_mean_s", statistics.fmean(t for ttfts in by_conversation for t in ttfts))
    figures.put("multiturn_ttft_turn0_s", statistics.fmean(ttfts[0] for ttfts in by_conversation))
    figures.put("multiturn_ttft_last_s", statistics.fmean(ttfts[-1] for ttfts in by_conversation))


async def measure(front: Front, args: argparse.Namespace, *, full: bool = True, round_index: int = 0, server_visit: int = 0) -> Figures:
    """One round of the workloads. Each round has its own prompts (so no round hits another's
    cache); the in-process engine and the first HTTP client get the same prompts in a round, and
    each later client's visit to the same server (``server_visit``) its own, or it would find the
    first one's prompts in the server's prefix cache."""
    rng = random.Random(f"{args.seed}:front-door:{round_index}" + (f":{server_visit}" if server_visit else ""))
    figures = Figures()
    await single_stream(front, figures, args.runs)
    if not full:
        await concurrent_streams(front, figures, 16, rng)
        return figures
    # Sampled and greedy back to back on this front, each first in turn (a run
    # with greedy always first read 0.93-0.94x through aiohttp; alternated,
    # single rounds ranged 0.93-1.11x), then their ratio.
    for sampled in (False, True) if round_index % 2 == 0 else (True, False):
        await concurrent_streams(front, figures, 16, rng, sampled=sampled)
    figures.put("streams16_sampled_vs_greedy", figures.values["streams16_sampled_tps"] / figures.values["streams16_tps"])
    await short_ttft(front, figures, args.ttft_requests, rng)
    await back_to_back(front, figures, args.qps_requests, rng)
    await cold_prefill(front, figures, args.runs, rng)
    await multiturn(front, figures, 4, 6, rng)
    return figures


# ---------------------------------------------------------------------------
# The three columns and the report
# ---------------------------------------------------------------------------


def median_of_rounds(rounds: list[Figures]) -> Figures:
    """Each figure's median over the rounds."""
    merged = Figures()
    for key in rounds[0].values:
        merged.put(key, statistics.median(r.values[key] for r in rounds))
    return merged


async def _alternating(url: str, args: argparse.Namespace) -> tuple[Figures, dict[str, Figures], Figures | None]:
    """In process and through HTTP with each client, round by round: in process, then each client, then again;
    unless ``--skip-previous``, each round also runs the in-process engine on the previous default kernels
    (``PREVIOUS_KERNELS``, switched process-wide for that visit: the server's process keeps its own).

    Both engines stay loaded and take turns (the idle one sleeps), so a stretch
    where this shared machine runs slower lands on every column instead of one:
    measured one after the other, the ratio moved by 0.2 between runs here.
    """
    from benchmarks.engine_bench import kernel_path
    from ember.config import EngineConfig
    from ember.engine.async_engine import AsyncEngine

    engine = AsyncEngine.for_model(None, EngineConfig(threads=args.threads))
    await engine.start_async()
    fronts = [CLIENTS[name](url) for name in args.clients.split(",")]
    in_process: list[Figures] = []
    previous_kernels: list[Figures] = []
    through_http: dict[str, list[Figures]] = {front.name: [] for front in fronts}
    try:
        for index in range(args.rounds):
            in_process.append(await measure(InProcessFront(engine), args, full=not args.quick, round_index=index))
            for visit, front in enumerate(fronts):
                figures = await measure(front, args, full=not args.quick, round_index=index, server_visit=visit)
                through_http[front.name].append(figures)
            if not args.skip_previous:
                with kernel_path(PREVIOUS_KERNELS):  # its own prompts: the engine's prefix cache holds the first visit's
                    previous_kernels.append(
                        await measure(InProcessFront(engine), args, full=not args.quick, round_index=index, server_visit=len(fronts) + 1)
                    )
    finally:
        for front in fronts:
            await front.close()
        engine.stop()
    previous = median_of_rounds(previous_kernels) if previous_kernels else None
    return median_of_rounds(in_process), {name: median_of_rounds(rounds) for name, rounds in through_http.items()}, previous


async def _previous_arrangement(args: argparse.Namespace) -> Figures:
    from ember.config import EngineConfig
    from ember.engine.async_engine import AsyncEngine
    from ember.engine.engine import LLMEngine

    engine = AsyncEngine(LLMEngine(None, EngineConfig(threads=args.threads)))  # built here, stepped on the engine thread
    await asyncio.to_thread(engine.start)
    try:
        return await measure(InProcessFront(engine), args, full=False)
    finally:
        engine.stop()


ROWS: list[tuple[str, str, str, float, str]] = [
    # key, label, unit, scale, target (HTTP / in process, or an absolute figure)
    ("decode_tps", "single-stream decode", "tok/s", 1.0, ">= 0.9x"),
    ("e2e_200_s", "200 tokens end to end, one stream", "s", 1.0, "<= 1.2 s"),
    ("ttft_short_p50_s", "TTFT p50, short chat prompt", "ms", 1000.0, "<= 20 ms"),
    ("qps_50", "50-token answers back to back", "req/s", 1.0, ">= 3.0"),
    ("streams16_tps", "16 streams x 200 tokens, output", "tok/s", 1.0, ">= 0.93x"),
    ("streams16_ttft_mean_s", "16 streams: TTFT mean", "ms", 1000.0, "<= 200 ms"),
    ("streams16_sampled_tps", "16 streams, temperature 0.7 / top_p 0.9, seeded", "tok/s", 1.0, ">= 0.93x"),
    ("streams16_sampled_vs_greedy", "  ... sampled / greedy (same front, same round)", "x", 1.0, ">= 0.95x"),
    ("prefill_tps", "cold prefill, ~1,000-token prompt", "tok/s", 1.0, ">= 0.95x"),
    ("multiturn_ttft_mean_s", "4 conversations x 6 turns: TTFT mean", "ms", 1000.0, "<= 60 ms"),
    ("multiturn_ttft_turn0_s", "  ... turn 1", "ms", 1000.0, ""),
    ("multiturn_ttft_last_s", "  ... turn 6", "ms", 1000.0, ""),
]

# Rows that are already a ratio within their column (HTTP / in process of them says nothing).
RATIO_KEYS = {key for key, _, unit, _, _ in ROWS if unit == "x"}


def report(
    engine: Figures, http: dict[str, Figures], previous: Figures | None, meta: dict[str, Any], previous_kernels: Figures | None = None
) -> str:
    """The markdown table: in process, then each client's HTTP figures with their ratio to in process."""

    def cell(figures: Figures | None, key: str, unit: str, scale: float) -> str:
        if figures is None or key not in figures.values:
            return ""
        value = figures.values[key] * scale
        if unit == "x":  # a ratio within one column
            return f"{value:.2f}x"
        return f"{value:,.1f} {unit}" if value < 100 else f"{value:,.0f} {unit}"

    def ratio(figures: Figures, key: str) -> str:
        if key in RATIO_KEYS:
            return ""
        if key in engine.values and key in figures.values and engine.values[key]:
            return f"{figures.values[key] / engine.values[key]:.2f}x"
        return ""

    client_heads = "".join(f" through HTTP ({name} client) | HTTP / in process |" for name in http)
    lines = [
        (
            f"Front door vs in process, one run ({meta['when']}; --threads {meta['threads']}; {meta['rounds']} alternating rounds, "
            f"medians; short prompts "
            f"~{engine.values.get('short_prompt_tokens', 0):.0f} tokens)"
        ),
        "",
        (
            f"| figure | in process (AsyncEngine) |{client_heads} previous kernels ({PREVIOUS_KERNELS}), in process | "
            "previous arrangement, in process | target |"
        ),
        "|---|---|" + "---|---|" * len(http) + "---|---|---|",
    ]
    for key, label, unit, scale, target in ROWS:
        client_cells = "".join(f" {cell(figures, key, unit, scale)} | {ratio(figures, key)} |" for figures in http.values())
        lines.append(
            f"| {label} | {cell(engine, key, unit, scale)} |{client_cells} {cell(previous_kernels, key, unit, scale)} | "
            f"{cell(previous, key, unit, scale)} | {target} |"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=2, help="engine threads, as `make serve` passes them (default %(default)s)")
    parser.add_argument("--runs", type=int, default=3, help="single-stream and prefill runs, median (default %(default)s)")
    parser.add_argument("--ttft-requests", type=int, default=15, help="short-prompt TTFT requests (default %(default)s)")
    parser.add_argument("--qps-requests", type=int, default=8, help="50-token requests back to back (default %(default)s)")
    parser.add_argument(
        "--rounds", type=int, default=2, help="alternating in-process / HTTP rounds; each figure is their median (default %(default)s)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--clients",
        default="aiohttp,httpx",
        help="HTTP load generators, comma-separated (aiohttp, httpx); the first is the 'http' figures of the JSON (default %(default)s)",
    )
    parser.add_argument("--skip-previous", action="store_true", help="leave out the previous-kernels and previous-arrangement columns")
    parser.add_argument("--quick", action="store_true", help="single-stream decode and 16 streams only (what make test checks)")
    parser.add_argument("--out", default=None, help="result directory (default bench-results/front-door-<timestamp>)")


def main(args: argparse.Namespace) -> int:
    from datetime import datetime

    root = Path(args.out or f"bench-results/front-door-{datetime.now():%Y%m%d-%H%M%S}")
    root.mkdir(parents=True, exist_ok=True)
    with ServerProcess("--request-timeout", "600", threads=args.threads) as server:  # make serve's defaults otherwise
        engine, http, previous_kernels = asyncio.run(_alternating(server.url, args))
    previous = None if args.skip_previous else asyncio.run(_previous_arrangement(args))
    meta = {"when": datetime.now().isoformat(timespec="seconds"), "threads": args.threads, "rounds": args.rounds}
    text = report(engine, http, previous, meta, previous_kernels)
    (root / "front-door.md").write_text(text + "\n")
    (root / "front-door.json").write_text(
        json.dumps(
            {
                "in_process": engine.values,
                "http": next(iter(http.values())).values,
                "http_by_client": {name: figures.values for name, figures in http.items()},
                "previous": previous.values if previous else None,
                "previous_kernels": previous_kernels.values if previous_kernels else None,
                **meta,
            },
            indent=1,
        )
    )
    print(text)
    print(f"\nwrote {root}/front-door.md, front-door.json")
    return 0
