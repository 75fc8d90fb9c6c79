"""The official openai package, sync and async, against a real `ember serve`."""

from __future__ import annotations

import asyncio

import openai
import pytest

from server_process import ServerProcess, metric_value

pytestmark = pytest.mark.timeout(180)
HELLO = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)


def test_chat_non_streaming(client):
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=HELLO, temperature=0, max_tokens=20)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop" and r.object == "chat.completion"
    assert r.usage.prompt_tokens > 10 and r.usage.completion_tokens == r.usage.total_tokens - r.usage.prompt_tokens


def test_chat_streaming_with_usage(client):
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=HELLO, temperature=0, max_tokens=20, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    # Ember's extension rides in prompt_tokens_details; the openai client keeps it.
    assert chunks[-1].usage.prompt_tokens_details.cache_tier in ("hot", "warm", "cold")


def test_n_streamed_choices_each_finish_and_share_the_prompt(server, client):
    """n=3, streamed: every choice streams to its own finish; the copies reference choice 0's
    prompt blocks instead of computing them (when they start is not asserted: that is timing)."""
    prompt = [{"role": "user", "content": "List three rivers of Europe and say which sea each reaches. " * 4}]
    before = metric_value(server.metrics(), "llm_prefix_cache_hits_total")
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=prompt,
        n=3,
        temperature=0.8,
        seed=5,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    texts, finishes, usage = {0: "", 1: "", 2: ""}, {}, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    hits = metric_value(server.metrics(), "llm_prefix_cache_hits_total") - before
    assert sorted(finishes) == [0, 1, 2] and all(texts.values())
    assert usage is not None and usage.completion_tokens == 3 * 12
    # Each copy finds every full 16-token block of the prompt but the last token's.
    full_blocks = (usage.prompt_tokens - 1) // 16 * 16
    assert hits >= 2 * full_blocks, (hits, usage.prompt_tokens)


def test_completions_endpoint(client):
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt="The capital of France is", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and len(r.choices[0].text) > 0 and r.usage.completion_tokens <= 8
    streamed = "".join(c.choices[0].text for c in client.completions.create(model="SmolLM2-135M-Instruct", prompt="The capital of France is", max_tokens=8, temperature=0, stream=True) if c.choices)
    assert streamed == r.choices[0].text


def test_stop_sequences(client):
    free = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=HELLO, temperature=0, max_tokens=20).choices[0].message.content
    cut = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=HELLO, temperature=0, max_tokens=20, stop=["Paris"])
    assert cut.choices[0].message.content == free[: free.index("Paris")]
    assert cut.choices[0].finish_reason == "stop"


def test_logprobs(client):
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=HELLO, temperature=0, max_tokens=5, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one, i.e. the first of the alternatives.
        assert entry.token == entry.top_logprobs[0].token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-6)


def test_error_classes(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=HELLO)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=HELLO, max_tokens=10**7)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=HELLO, n=17)  # more choices than Ember allows
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[])


def test_async_client(server):
    async def main():
        client = openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0)
        replies = await asyncio.gather(*[
            client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=HELLO, temperature=0, max_tokens=12) for _ in range(4)
        ])
        stream = await client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=HELLO, temperature=0, max_tokens=12, stream=True)
        streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        await client.close()
        return replies, streamed

    replies, streamed = asyncio.run(main())
    texts = {r.choices[0].message.content for r in replies}
    assert len(texts) == 1 and streamed in texts  # greedy: identical whatever the batching


def test_models_list(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct"]


@pytest.fixture(scope="module")
def keyed_server():
    proc = ServerProcess("--api-key", "s3cret", "--warmup-requests", "1").wait_ready()
    yield proc
    proc.stop()


def test_api_key_required(keyed_server):
    import httpx

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed_server.url, api_key="wrong", max_retries=0).models.list()
    ok = openai.OpenAI(base_url=keyed_server.url, api_key="s3cret", max_retries=0)
    assert ok.chat.completions.create(model="SmolLM2-135M-Instruct", messages=HELLO, max_tokens=3).choices
    assert httpx.get(f"{keyed_server.base}/health").status_code == 200  # public
    assert httpx.get(f"{keyed_server.base}/ready").status_code == 200
