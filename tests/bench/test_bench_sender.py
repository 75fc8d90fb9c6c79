"""The sender against scripted replies (httpx.MockTransport): parsing, token counts, error kinds."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import httpx
import pytest

from ember.bench.record import Clock, RequestRecord
from ember.bench.sender import BenchError, Sender, Target
from ember.bench.workloads import RequestSpec

pytestmark = pytest.mark.timeout(30)

Handler = Callable[[httpx.Request], httpx.Response]


def sse(*payloads: object) -> bytes:
    return b"".join(b"data: " + (p if isinstance(p, bytes) else json.dumps(p).encode()) + b"\n\n" for p in payloads)


def chunk(content: str | None = None, *, role: str | None = None, finish: str | None = None, **extra: object) -> dict:
    delta = {k: v for k, v in (("role", role), ("content", content)) if v is not None}
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish, **extra}]}


def stream_reply(body: bytes, status: int = 200, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.Response(status, content=body, headers={"content-type": "text/event-stream", **(headers or {})})


def send(handler: Handler, spec: RequestSpec, seen: list[httpx.Request] | None = None) -> tuple[RequestRecord, Sender]:
    def recording(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(request)
        return handler(request)

    async def main() -> tuple[RequestRecord, Sender]:
        async with Sender(Target(url="http://bench.test/v1", model="m"), Clock(), transport=httpx.MockTransport(recording)) as sender:
            return await sender.send(spec, index=0), sender

    return asyncio.run(main())


STORY = [{"role": "user", "content": "hi"}]


def test_stream_with_usage_counts_tokens_from_usage():
    body = sse(
        chunk("", role="assistant"),  # the role chunk carries no text: it is not the first token
        chunk("Hel"),
        chunk("lo"),
        chunk(finish="length"),
        {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 4}}},
        b"[DONE]",
    )
    seen: list[httpx.Request] = []
    record, sender = send(lambda r: stream_reply(body, headers={"X-Ember-Max-Tokens": "3"}), RequestSpec(STORY, 3, ignore_eos=True, session_id="s1"), seen)
    assert record.ok and record.status == 200
    assert record.output_text == "Hello" and len(record.chunk_times_s) == 2
    assert (record.prompt_tokens, record.output_tokens, record.cached_tokens) == (9, 3, 4)
    assert record.output_tokens_source == "usage" and record.finish_reason == "length"
    assert record.start_s <= record.chunk_times_s[0] <= record.end_s
    assert sender.server_is_ember
    body_sent = json.loads(seen[0].content)
    assert body_sent["stream"] is True and body_sent["stream_options"] == {"include_usage": True}
    assert body_sent["ignore_eos"] is True and body_sent["model"] == "m" and body_sent["max_tokens"] == 3
    assert seen[0].headers["X-Session-ID"] == "s1"
    assert seen[0].url == "http://bench.test/v1/chat/completions"


def test_stream_without_usage_counts_text_chunks():
    body = sse(chunk("", role="assistant"), chunk("a"), chunk("b"), chunk("c"), chunk(finish="stop"), b"[DONE]")
    record, sender = send(lambda r: stream_reply(body), RequestSpec(STORY, 8))
    assert record.ok and record.output_tokens == 3 and record.output_tokens_source == "chunks"
    assert record.prompt_tokens is None and record.finish_reason == "stop"
    assert not sender.server_is_ember


def test_plain_openai_body_has_no_extensions():
    seen: list[httpx.Request] = []
    send(lambda r: stream_reply(sse(chunk("x"), b"[DONE]")), RequestSpec(STORY, 8), seen)
    body_sent = json.loads(seen[0].content)
    assert "ignore_eos" not in body_sent and "session_id" not in body_sent
    assert "X-Session-ID" not in seen[0].headers


def test_non_streamed_reply_shows_its_text_at_the_end():
    payload = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi there"}, "finish_reason": "stop"}],
               "usage": {"prompt_tokens": 5, "completion_tokens": 2}}
    seen: list[httpx.Request] = []
    record, _ = send(lambda r: httpx.Response(200, json=payload), RequestSpec(STORY, 8, stream=False), seen)
    assert record.ok and record.output_text == "Hi there" and record.output_tokens == 2
    assert record.chunk_times_s and record.ttft_s <= record.e2e_s
    assert record.tpot_s is None  # no per-token timing without a stream
    assert "stream" not in json.loads(seen[0].content)


def test_error_status_is_recorded_by_kind():
    error = {"error": {"message": "slow down", "type": "rate_limit_error", "param": None, "code": 429}}
    record, _ = send(lambda r: httpx.Response(429, json=error), RequestSpec(STORY, 8))
    assert not record.ok and record.error_kind == "http_429" and record.status == 429
    assert record.error == "slow down"


def test_error_chunk_inside_a_stream():
    body = sse(chunk("", role="assistant"), chunk("a"), {"error": {"message": "engine died", "type": "server_error"}}, b"[DONE]")
    record, _ = send(lambda r: stream_reply(body), RequestSpec(STORY, 8))
    assert record.error_kind == "stream_error" and record.error == "engine died"


def test_transport_errors_are_classified():
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    def time_out(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("slow", request=request)

    assert send(refuse, RequestSpec(STORY, 8))[0].error_kind == "connect"
    assert send(time_out, RequestSpec(STORY, 8))[0].error_kind == "timeout"
    garbage = send(lambda r: stream_reply(b"data: {not json\n\n"), RequestSpec(STORY, 8))[0]
    assert garbage.error_kind == "bad_response"


def test_model_discovery_and_its_errors():
    def models(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/models"
        return httpx.Response(200, json={"object": "list", "data": [{"id": "first"}, {"id": "second"}]})

    async def discover(handler: Handler) -> str:
        async with Sender(Target(url="http://bench.test/v1"), Clock(), transport=httpx.MockTransport(handler)) as sender:
            return sender.model

    assert asyncio.run(discover(models)) == "first"
    with pytest.raises(BenchError, match="pass --model"):
        asyncio.run(discover(lambda r: httpx.Response(200, json={"data": []})))


def test_stream_that_ends_without_a_finish_is_incomplete():
    record, _ = send(lambda r: stream_reply(sse(chunk("", role="assistant"), chunk("a"))), RequestSpec(STORY, 8))
    assert record.error_kind == "incomplete" and not record.ok
    # A server that answers a stream request with plain JSON sends no events at all.
    record, _ = send(lambda r: httpx.Response(200, json={"choices": []}), RequestSpec(STORY, 8))
    assert record.error_kind == "incomplete"
