"""The in-process ASGI runner replicas serve requests with (no Ray)."""

from __future__ import annotations

import asyncio
import json

import pytest

from ember.ray.exchange import HttpExchange, run_asgi


async def collect(app, exchange: HttpExchange, extra=()) -> list[dict]:
    return [message async for batch in run_asgi(app, exchange, list(extra)) for message in batch]


@pytest.mark.timeout(10)
def test_the_app_sees_the_request_and_its_messages_come_back_with_the_extra_header() -> None:
    seen: dict = {}

    async def app(scope, receive, send):
        seen["scope"] = scope
        seen["body"] = (await receive())["body"]
        await send({"type": "http.response.start", "status": 201, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        await send({"type": "http.response.body", "body": b"b", "more_body": False})

    exchange = HttpExchange("POST", "/v1/x", b"q=1", ((b"x-session-id", b"s1"),), b"{}", ("10.1.2.3", 5))
    messages = asyncio.run(collect(app, exchange, [(b"x-ember-replica", b"r1")]))
    assert seen["body"] == b"{}"
    scope = seen["scope"]
    assert (scope["method"], scope["path"], scope["query_string"], scope["client"]) == ("POST", "/v1/x", b"q=1", ("10.1.2.3", 5))
    assert scope["headers"] == [(b"x-session-id", b"s1")] and scope["state"] == {}
    assert messages[0]["status"] == 201
    assert messages[0]["headers"] == [(b"content-type", b"text/plain"), (b"x-ember-replica", b"r1")]
    assert b"".join(m.get("body", b"") for m in messages[1:]) == b"ab"


@pytest.mark.timeout(10)
def test_leaving_early_is_a_disconnect_to_the_app_and_cancels_it() -> None:
    events: list[str] = []

    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        try:
            message = await receive()  # waits for the client to leave
            events.append(message["type"])
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            events.append("cancelled")
            raise

    async def main() -> None:
        stream = run_asgi(app, HttpExchange("GET", "/"))
        first = await stream.__anext__()
        assert [m["type"] for m in first][0] == "http.response.start"
        await stream.aclose()
        await asyncio.sleep(0.05)

    asyncio.run(main())
    assert events[0] in ("http.disconnect", "cancelled")
    assert "cancelled" in events


@pytest.mark.timeout(10)
def test_an_app_that_raises_before_answering_gives_an_openai_500() -> None:
    async def app(scope, receive, send):
        raise RuntimeError("boom")

    messages = asyncio.run(collect(app, HttpExchange("GET", "/")))
    assert messages[0]["status"] == 500
    assert json.loads(messages[1]["body"])["error"]["type"] == "server_error"
