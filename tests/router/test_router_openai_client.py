"""The official ``openai`` package works through the router, unchanged."""

from __future__ import annotations

import openai
import pytest


def client_for(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="sk-test", max_retries=0, timeout=10)


@pytest.mark.timeout(20)
def test_chat_completion_non_streaming(upstreams, start_router) -> None:
    a = upstreams[0]
    router = start_router([a.url])
    with client_for(router) as client:
        completion = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}])
    assert completion.choices[0].message.content == "Hello from a!"
    assert completion.usage is not None and completion.usage.completion_tokens == 4
    assert a.completions_seen()[0].headers["authorization"] == "Bearer sk-test"


@pytest.mark.timeout(20)
def test_chat_completion_streaming(upstreams, start_router) -> None:
    router = start_router([upstreams[0].url, upstreams[1].url])
    with client_for(router) as client:
        stream = client.chat.completions.create(
            model="fake-model",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            extra_headers={"X-Session-ID": "openai-client-session"},
        )
        chunks = list(stream)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert text in ("Hello from a!", "Hello from b!")
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.timeout(20)
def test_completions_and_models(upstreams, start_router) -> None:
    router = start_router([upstreams[0].url])
    with client_for(router) as client:
        assert client.completions.create(model="fake-model", prompt="Once").choices[0].text == "Hello from a!"
        stream = client.completions.create(model="fake-model", prompt="Once", stream=True)
        streamed = "".join(chunk.choices[0].text for chunk in stream)
        assert streamed == "Hello from a!"
        assert [m.id for m in client.models.list()] == ["fake-model"]


@pytest.mark.timeout(20)
def test_broken_stream_raises_a_clean_api_error(upstreams, start_router) -> None:
    a = upstreams[0]
    a.mode = "drop"
    router = start_router([a.url])
    with client_for(router) as client:
        stream = client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        received = []
        with pytest.raises(openai.APIError, match="failed mid-response"):
            for chunk in stream:
                received.append(chunk.choices[0].delta.content or "")
    assert "".join(received) == "Hello from"


@pytest.mark.timeout(20)
def test_router_errors_reach_the_client_as_typed_errors(start_router) -> None:
    router = start_router([])
    with client_for(router) as client, pytest.raises(openai.InternalServerError) as caught:
        client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.status_code == 503
    assert caught.value.body["code"] == "no_upstream_available"
