"""The SDK against a real `ember serve`: a streaming conversation with its session id, and warmup."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from ember.client import AsyncClient, Client

pytestmark = pytest.mark.timeout(180)


def test_streaming_conversation_keeps_the_session_warm(ember_server):
    server = ember_server
    with Client(server.url) as client:
        warm = client.warmup(connections=2)
        assert all(w.error is None for w in warm)
        chat = client.conversation(system="You are a concise travel assistant.", max_tokens=16, temperature=0)
        first = chat.stream("Name a city in Portugal.")
        text = "".join(first)
        assert text and first.result.ttft_s is not None and first.result.usage.completion_tokens > 0
        second = chat.stream("What is it famous for?")
        assert "".join(second)
        usage = second.result.usage
        # The server kept the conversation: the whole first turn came from its cache.
        assert usage.cached_tokens >= first.result.usage.prompt_tokens - 16
        assert len(chat.messages) == 5  # system, two user turns, two answers
    listed = httpx.get(f"{server.url}/sessions/{chat.session_id}").json()
    assert listed["tier"] == "hot" and listed["tokens"] >= usage.prompt_tokens


def test_async_client_and_batch_against_the_server(ember_server):
    server = ember_server
    async def main():
        async with AsyncClient(server.url) as client:
            results = await client.batch(
                [{"messages": [{"role": "user", "content": f"Say {w}."}], "max_tokens": 4} for w in ("yes", "no", "maybe")],
                concurrency=3,
            )
            bad = await client.batch([{"messages": [], "max_tokens": 4}], concurrency=1)
            return results, bad

    results, bad = asyncio.run(main())
    assert [type(r).__name__ for r in results] == ["ChatResult"] * 3
    assert type(bad[0]).__name__ == "BadRequestError" and bad[0].status_code == 400
