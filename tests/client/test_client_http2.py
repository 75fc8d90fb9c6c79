"""HTTP/2 end to end: hypercorn speaking h2c (prior knowledge) to a client with http2=True."""

from __future__ import annotations

import asyncio

import pytest
from client_fake_server import Reply

from ember.client import APIConnectionError, AsyncClient, Client, RetryPolicy

pytestmark = pytest.mark.timeout(60)


@pytest.mark.asyncio
async def test_many_requests_share_one_http2_connection(serve) -> None:
    server = serve(http2=True)
    server.app.default = Reply(deltas=["a", "b"], delta_delay_s=0.02)
    async with AsyncClient(server.url, http2=True) as client:
        sequential = [await client.chat(f"s{i}") for i in range(5)]
        concurrent = await asyncio.gather(*(client.chat(f"c{i}") for i in range(10)))
        streamed = [delta async for delta in client.stream_chat("stream")]
    assert {r.http_version for r in sequential + list(concurrent)} == {"HTTP/2"}
    assert {r.text for r in sequential + list(concurrent)} == {"ab"}
    assert streamed == ["a", "b"]
    seen = server.app.completions
    assert len(seen) == 16
    assert {s.http_version for s in seen} == {"2"}
    assert len({s.client for s in seen}) == 1  # one TCP connection carried all 16
    assert server.app.max_in_flight >= 2  # and they were multiplexed, not queued


def test_http2_warmup_and_a_broken_stream(serve) -> None:
    server = serve(http2=True)
    server.app.default = Reply(deltas=["x", "y"], drop_after=1)
    with Client(server.url, http2=True, retry=RetryPolicy(initial_backoff_s=0.01)) as client:
        [report] = client.warmup()
        received: list[str] = []
        with pytest.raises(APIConnectionError):
            for delta in client.stream_chat("hi"):
                received.append(delta)
        server.app.default = Reply()
        result = client.chat("after the reset")
    assert report.http_version == "HTTP/2"
    assert received == ["x"]
    assert result.text == "Hello world"
    assert len(server.app.completions) == 2  # the broken stream was not retried
