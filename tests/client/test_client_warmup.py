"""AsyncClient.warmup: pooled connections opened ahead of traffic, then reused."""

from __future__ import annotations

import asyncio

import pytest
from client_fake_server import Reply, closed_port_url

from ember.client import AsyncClient, Client, RetryPolicy

pytestmark = pytest.mark.timeout(30)


@pytest.mark.asyncio
async def test_warmup_opens_n_connections_that_later_requests_reuse(server) -> None:
    server.app.default = Reply(delta_delay_s=0.05)  # long enough for three chats to overlap
    async with AsyncClient(server.url) as client:
        [report] = await client.warmup(connections=3)
        warm_ports = {seen.client[1] for seen in server.app.seen}
        await asyncio.gather(*(client.chat(f"q{i}") for i in range(3)))
        await client.chat("and the connections went back to the pool")
    assert (report.ok, report.base_url, report.connections, report.http_version) == (True, server.url, 3, "HTTP/1.1")
    assert [(seen.method, seen.path) for seen in server.app.seen[:3]] == [("GET", "/v1/models")] * 3
    assert len(warm_ports) == 3
    assert {seen.client[1] for seen in server.app.completions} == warm_ports  # no new handshake


def test_chat_probe_sends_a_one_token_chat(server) -> None:
    server.app.default = Reply(json={"choices": [{"index": 0, "message": {"content": "k"}, "finish_reason": "length"}]})
    with Client(server.url, model="tiny") as client:
        [report] = client.warmup(probe="chat")
    assert report.ok
    [seen] = server.app.completions
    assert seen.body == {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "stream": False, "model": "tiny"}


def test_an_unreachable_url_is_reported_and_cools_down(server) -> None:
    dead_url = closed_port_url()
    with Client(base_urls=[dead_url, server.url], retry=RetryPolicy(initial_backoff_s=5.0)) as client:
        dead, alive = client.warmup()
        result = client.chat("hi")
    assert (dead.ok, alive.ok) == (False, True)
    assert type(dead.error).__name__ == "APIConnectionError"
    assert (result.base_url, result.attempts) == (server.url, 1)  # the dead URL was skipped, not retried


def test_warmup_reports_an_error_status(server) -> None:
    server.app.models_status = 401
    with Client(server.url) as client:
        [report] = client.warmup()
    assert not report.ok and report.error.status_code == 401
