"""``ember bench router-overhead`` against two scripted servers: one answers later than the other."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from ember.bench.experiments import BenchContext
from ember.bench.metrics import SLO
from ember.bench.progress import BenchProgress
from ember.bench.record import Clock
from ember.bench.router_overhead import run_router_overhead
from ember.bench.sender import Sender, Target

pytestmark = pytest.mark.timeout(30)

ROUTER_DELAY_S = 0.02


def scripted_server(delay_s: float) -> httpx.MockTransport:
    """A streaming chat server that waits ``delay_s`` before its reply (4 tokens)."""

    async def handle(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(delay_s)
        events = [{"choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}]} for word in "abcd"]
        events.append({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4}})
        body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handle)


def test_overhead_is_the_difference_between_the_two_paths() -> None:
    async def main():
        clock = Clock()
        router_target = Target(url="http://router.test/v1", model="m")
        routed = Sender(router_target, clock, transport=scripted_server(ROUTER_DELAY_S))
        direct = Sender(Target(url="http://replica.test/v1", model="m"), clock, transport=scripted_server(0.0))
        async with routed, direct:
            ctx = BenchContext(routed, clock, SLO(), 0, BenchProgress(quiet=True), ignore_eos=True)
            return await run_router_overhead(ctx, direct, pairs=4, max_tokens=4, concurrency=2, requests=4, rounds=2)

    result = asyncio.run(main())
    assert result.extras["ttft_overhead_s"] == pytest.approx(ROUTER_DELAY_S, abs=0.015)
    tokens_per_s = result.extras["output_tokens_per_s"]
    assert tokens_per_s["direct"] > tokens_per_s["routed"] > 0
    assert 0 < result.extras["throughput_loss"] < 1
    labels = [group.label for group in result.groups]
    assert labels == ["ttft-routed", "ttft-direct", "load-routed-1", "load-routed-2", "load-direct-1", "load-direct-2"]
    assert all(len(group.records) == 4 and all(r.ok for r in group.records) for group in result.groups)
    assert "Router overhead" in result.sections[0].title
