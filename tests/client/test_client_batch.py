"""ember.client.batch: bounded concurrency, input order, per-item errors."""

from __future__ import annotations

import pytest
from client_fake_server import Reply, Seen

from ember.client import AsyncClient, BadRequestError, ChatResult, Client, RetryPolicy, ServerError

pytestmark = pytest.mark.timeout(30)


def echo_or_fail(seen: Seen) -> Reply:
    """Echo the last user message back; "fail..." prompts get an error instead."""
    prompt = seen.body["messages"][-1]["content"]
    if prompt.startswith("fail-400"):
        return Reply(status=400, json={"error": {"message": f"bad {prompt}", "type": "invalid_request_error"}})
    if prompt.startswith("fail-500"):
        return Reply(status=500, json={"error": {"message": f"boom {prompt}", "type": "server_error"}})
    return Reply(deltas=[prompt], delta_delay_s=0.05)


def test_batch_returns_results_and_errors_in_input_order(server) -> None:
    server.app.respond = echo_or_fail
    prompts = ["p0", "fail-400-a", "p2", [{"role": "user", "content": "p3"}], "fail-500-b", "p5"]
    with Client(server.url, retry=RetryPolicy(max_retries=1, initial_backoff_s=0.01)) as client:
        results = client.batch(prompts, concurrency=3, max_tokens=4)
    assert [type(r) for r in results] == [ChatResult, BadRequestError, ChatResult, ChatResult, ServerError, ChatResult]
    assert [r.text for r in results if isinstance(r, ChatResult)] == ["p0", "p2", "p3", "p5"]
    assert results[1].message == "bad fail-400-a"
    assert results[4].attempts == 2  # the 500 was retried once before becoming the item's result
    assert all(seen.body["max_tokens"] == 4 for seen in server.app.completions)


@pytest.mark.asyncio
async def test_batch_bounds_concurrency(server) -> None:
    server.app.respond = echo_or_fail
    async with AsyncClient(server.url) as client:
        results = await client.batch([f"p{i}" for i in range(10)], concurrency=3)
    assert [r.text for r in results] == [f"p{i}" for i in range(10)]
    assert server.app.max_in_flight == 3


@pytest.mark.asyncio
async def test_batch_items_may_carry_their_own_keywords(server) -> None:
    server.app.respond = echo_or_fail
    requests = [
        {"messages": "first", "max_tokens": 1, "session_id": "s-1"},
        {"messages": [{"role": "user", "content": "second"}], "temperature": 0.5},
        {"prompt": "no messages key"},
    ]
    async with AsyncClient(server.url) as client:
        first, second, third = await client.batch(requests, concurrency=2, max_tokens=9)
    assert (first.text, second.text) == ("first", "second")
    assert isinstance(third, ValueError)
    bodies = {seen.body["messages"][-1]["content"]: seen for seen in server.app.completions}
    assert bodies["first"].body["max_tokens"] == 1 and bodies["first"].headers["x-session-id"] == "s-1"
    assert bodies["second"].body["max_tokens"] == 9 and bodies["second"].body["temperature"] == 0.5


@pytest.mark.asyncio
async def test_empty_batch_and_bad_concurrency(server) -> None:
    async with AsyncClient(server.url) as client:
        assert await client.batch([]) == []
        with pytest.raises(ValueError):
            await client.batch(["x"], concurrency=0)
