"""Client and AsyncClient against a fake server: wire format, results, headers, API keys."""

from __future__ import annotations

import threading

import pytest
from client_fake_server import DEFAULT_USAGE, Reply

from ember.client import AsyncClient, ChatResult, Client, Usage

pytestmark = pytest.mark.timeout(30)


def test_chat_sends_the_openai_body_and_returns_a_typed_result(server) -> None:
    with Client(server.url, model="tiny") as client:
        result = client.chat([{"role": "user", "content": "hi"}], max_tokens=5, temperature=0.0)
    assert isinstance(result, ChatResult)
    assert (result.text, result.finish_reason, result.model, result.response_id) == ("Hello world", "stop", "fake", "cmpl-fake")
    assert result.usage == Usage(**DEFAULT_USAGE)
    assert (result.attempts, result.retries, result.base_url, result.http_version) == (1, 0, server.url, "HTTP/1.1")
    assert 0 < result.ttft_s <= result.latency_s
    [seen] = server.app.completions
    assert (seen.method, seen.path) == ("POST", "/v1/chat/completions")
    assert seen.body == {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    assert result.request_id == seen.headers["x-request-id"]
    assert len(result.request_id) == 32


def test_a_string_is_one_user_message_and_model_can_be_omitted(server) -> None:
    with Client(server.url, include_usage=False) as client:
        result = client.chat("hello")
    assert server.app.completions[0].body == {"messages": [{"role": "user", "content": "hello"}], "stream": True}
    assert result.usage is None


def test_stream_chat_yields_deltas_then_a_result(server) -> None:
    server.app.default = Reply(deltas=["a", "b", "c"])
    with Client(server.url) as client:
        with client.stream_chat("hi") as stream:
            with pytest.raises(RuntimeError):
                stream.result
            deltas = list(stream)
            assert stream.ttft_s is not None
    assert deltas == ["a", "b", "c"]
    assert (stream.result.text, stream.result.finish_reason) == ("abc", "stop")
    assert stream.result.usage is not None and stream.result.usage.total_tokens == 9


def test_the_request_is_sent_when_iteration_starts(server) -> None:
    with Client(server.url) as client:
        stream = client.stream_chat("hi")
        assert server.app.completions == []
        assert next(stream) == "Hello"
        stream.close()


def test_complete_uses_the_completions_route(server) -> None:
    server.app.default = Reply(deltas=["4"], finish_reason="length")
    with Client(server.url, model="tiny") as client:
        result = client.complete("2+2=", max_tokens=1)
    assert (result.text, result.finish_reason) == ("4", "length")
    assert server.app.completions[0].path == "/v1/completions"
    assert server.app.completions[0].body["prompt"] == "2+2="


def test_a_server_answering_plain_json_to_a_stream_request_still_works(server) -> None:
    body = {
        "id": "chatcmpl-1",
        "model": "other",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "whole"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }
    server.app.default = Reply(json=body)
    with Client(server.url) as client:
        result = client.chat("hi")
    assert (result.text, result.finish_reason, result.usage, result.response_id) == ("whole", "stop", Usage(3, 1, 4), "chatcmpl-1")


def test_stream_is_chosen_by_the_method() -> None:
    with Client("http://127.0.0.1:9/v1") as client:
        with pytest.raises(ValueError, match="stream"):
            client.chat("hi", stream=False)


def test_base_urls_are_validated() -> None:
    with pytest.raises(ValueError):
        Client("127.0.0.1:8000/v1")
    with pytest.raises(ValueError):
        Client("http://a/v1", base_urls=["http://b/v1"])


def test_api_key_from_the_environment(server, monkeypatch) -> None:
    monkeypatch.delenv("EMBER_API_KEY", raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai")
    with Client(server.url) as client:
        client.chat("hi")
    monkeypatch.setenv("EMBER_API_KEY", "sk-ember")
    with Client(server.url) as client:
        client.chat("hi")
    with Client(server.url, api_key="sk-explicit") as client:
        client.chat("hi")
    sent = [seen.headers.get("authorization") for seen in server.app.completions]
    assert sent == ["Bearer sk-openai", "Bearer sk-ember", "Bearer sk-explicit"]


def test_no_api_key_sends_no_authorization(server, monkeypatch) -> None:
    monkeypatch.delenv("EMBER_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with Client(server.url) as client:
        client.chat("hi")
    assert "authorization" not in server.app.completions[0].headers


def test_extension_headers(server) -> None:
    with Client(server.url, priority="low", headers={"X-Team": "search"}) as client:
        client.chat("a")
        client.chat("b", priority=0, session_id="sess-1", headers={"X-Request-ID": "given-id"})
        result = client.chat("c", request_id="kw-id")
    first, second, third = (seen.headers for seen in server.app.completions)
    assert (first["x-priority"], first["x-team"], "x-session-id" in first) == ("low", "search", False)
    assert (second["x-priority"], second["x-session-id"], second["x-request-id"]) == ("0", "sess-1", "given-id")
    assert third["x-request-id"] == result.request_id == "kw-id"
    assert "x-request-timeout" not in first  # no deadline, no header
    assert first["accept-encoding"] == "identity"


def test_the_request_id_repeats_on_retries(server) -> None:
    from ember.client import RetryPolicy

    server.app.script = [Reply(status=503, json={"error": {"message": "busy"}})]
    with Client(server.url, retry=RetryPolicy(initial_backoff_s=0.01)) as client:
        result = client.chat("hi")
    ids = {seen.headers["x-request-id"] for seen in server.app.completions}
    assert len(server.app.completions) == 2 and ids == {result.request_id}


def test_one_client_shared_by_threads_reuses_its_pool(server) -> None:
    server.app.default = Reply(delta_delay_s=0.1)
    results: list[str] = []
    with Client(server.url) as client:
        threads = [threading.Thread(target=lambda: results.append(client.chat("hi").text)) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        ports_before = {seen.client[1] for seen in server.app.completions}
        client.chat("after")
    assert results == ["Hello world"] * 4
    assert server.app.max_in_flight == 4  # they really ran concurrently
    assert server.app.completions[-1].client[1] in ports_before  # a pooled connection was reused


def test_a_closed_client_refuses_work(server) -> None:
    client = Client(server.url)
    client.close()
    client.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        client.chat("hi")


@pytest.mark.asyncio
async def test_async_client_chat_stream_and_complete(server) -> None:
    async with AsyncClient(server.url, model="tiny") as client:
        result = await client.chat("hi")
        deltas = [delta async for delta in client.stream_chat("hi")]
        completion = await client.complete("once upon")
    assert result.text == "Hello world"
    assert deltas == ["Hello", " world"]
    assert completion.text == "Hello world"
    assert len({seen.client for seen in server.app.completions}) == 1  # one keep-alive connection
