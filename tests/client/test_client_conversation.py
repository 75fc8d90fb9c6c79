"""ember.client.conversation: history, session id, and turns that only count when complete."""

from __future__ import annotations

import pytest
from client_fake_server import Reply, Seen

from ember.client import AsyncClient, BadRequestError, Client, RetryPolicy

pytestmark = pytest.mark.timeout(30)


def echo(seen: Seen) -> Reply:
    return Reply(deltas=["re: ", seen.body["messages"][-1]["content"]])


def test_send_keeps_history_and_session(server) -> None:
    server.app.respond = echo
    with Client(server.url) as client:
        chat = client.conversation(system="be brief", max_tokens=8)
        assert chat.send("one").text == "re: one"
        with chat.stream("two") as stream:
            assert "".join(stream) == "re: two"
    assert chat.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "re: one"},
        {"role": "user", "content": "two"},
        {"role": "assistant", "content": "re: two"},
    ]
    first, second = server.app.completions
    assert second.body["messages"] == chat.messages[:4]
    assert first.headers["x-session-id"] == second.headers["x-session-id"] == chat.session_id
    assert first.body["max_tokens"] == second.body["max_tokens"] == 8
    assert "session_id" not in first.body  # header only: plain OpenAI endpoints reject unknown fields


def test_a_failed_turn_leaves_the_history_unchanged(server) -> None:
    server.app.script = [Reply(status=400, json={"error": {"message": "no"}})]
    server.app.default = Reply(deltas=["ok"])
    with Client(server.url, retry=RetryPolicy(max_retries=0)) as client:
        chat = client.conversation(session_id="fixed")
        with pytest.raises(BadRequestError):
            chat.send("first try")
        assert chat.messages == []
        chat.send("second try")
    assert chat.messages == [{"role": "user", "content": "second try"}, {"role": "assistant", "content": "ok"}]
    assert {seen.headers["x-session-id"] for seen in server.app.completions} == {"fixed"}


@pytest.mark.asyncio
async def test_async_conversation_and_an_abandoned_stream(server) -> None:
    server.app.respond = echo
    async with AsyncClient(server.url) as client:
        chat = client.conversation()
        async with chat.stream("dropped") as stream:
            async for _ in stream:
                break  # abandoned after the first delta: not a complete turn
        assert chat.messages == []
        result = await chat.send("kept")
    assert result.text == "re: kept"
    assert chat.messages == [{"role": "user", "content": "kept"}, {"role": "assistant", "content": "re: kept"}]
