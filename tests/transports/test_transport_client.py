"""The SDK with transport="grpc": the same API, errors, retries, deadlines and failover as over HTTP."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from ember.client import (
    APIConnectionError,
    AsyncClient,
    AuthenticationError,
    BadRequestError,
    Client,
    DeadlineExceeded,
    RateLimitedError,
    RetryPolicy,
    Timeouts,
)
from ember.grpc.api import pb, pb_grpc
from server_process import ServerProcess, free_port
from transport_common import API_KEY, wait_engine_idle

pytestmark = pytest.mark.timeout(120)

NO_RETRY = RetryPolicy(max_retries=0)


def test_chat_stream_and_complete(grpc_server: ServerProcess) -> None:
    with Client(grpc_server.grpc_url, transport="grpc", api_key=API_KEY) as client:
        result = client.chat("Hi", max_tokens=6, temperature=0, ignore_eos=True, request_id="sdk-grpc-1")
        assert result.http_version == "grpc" and result.request_id == "sdk-grpc-1"
        assert result.finish_reason == "length" and result.usage is not None and result.usage.completion_tokens == 6
        assert result.response_id and result.response_id.startswith("chatcmpl-") and result.model and result.ttft_s is not None
        with client.stream_chat("Hi", max_tokens=6, temperature=0) as stream:
            deltas = list(stream)
        assert "".join(deltas) == stream.result.text == result.text
        completion = client.complete("The capital of France is", max_tokens=4, temperature=0)
        assert completion.text.strip() and completion.usage is not None and completion.usage.completion_tokens <= 4
        assert [w.ok for w in client.warmup()] == [True]


def test_errors_map_to_the_same_exceptions_as_over_http(grpc_server: ServerProcess) -> None:
    with Client(grpc_server.grpc_url, transport="grpc", api_key=API_KEY, retry=NO_RETRY) as client:
        with pytest.raises(BadRequestError) as bad:
            client.chat("Hi", temperature=5)
        assert bad.value.status_code == 400 and bad.value.param == "temperature" and bad.value.code == "invalid_value"
        with pytest.raises(ValueError, match="not supported over gRPC: logprobs"):
            client.chat("Hi", logprobs=True)
    with Client(grpc_server.grpc_url, transport="grpc", retry=NO_RETRY) as client:
        with pytest.raises(AuthenticationError) as auth:
            client.chat("Hi")
        assert auth.value.status_code == 401 and auth.value.code == "invalid_api_key"


def test_the_deadline_is_the_grpc_deadline_and_the_server_lets_go(grpc_server: ServerProcess) -> None:
    with Client(grpc_server.grpc_url, transport="grpc", api_key=API_KEY) as client:
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            # More tokens than any engine here streams in 1 s: the deadline must end the call.
            client.chat("Tell me a long story.", max_tokens=1000, ignore_eos=True, deadline_s=1.0)
        assert time.monotonic() - started < 2.0
    wait_engine_idle(grpc_server, within_s=3.0)


def test_overload_is_rate_limited_with_retry_after_then_retried(grpc_server: ServerProcess) -> None:
    async def main() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_server.grpc_port}") as channel:
            request = pb.ChatRequest(messages=[pb.Message(role="user", content="A long story, please.")], sampling=pb.SamplingOptions(max_tokens=400, ignore_eos=True))
            held = pb_grpc.GenerationStub(channel).Chat(request, metadata=(("authorization", f"Bearer {API_KEY}"),), timeout=60)
            await held.read()  # the server's only slot is taken
            try:
                async with AsyncClient(grpc_server.grpc_url, transport="grpc", api_key=API_KEY, retry=NO_RETRY) as client:
                    with pytest.raises(RateLimitedError) as limited:
                        await client.chat("Hi", max_tokens=2)
                assert limited.value.status_code == 429 and limited.value.retry_after_s is not None and limited.value.retry_after_s >= 1
                # With retries (the server's hint capped at 0.3 s) the call succeeds once the slot is free.
                retrying = RetryPolicy(max_retries=10, max_retry_after_s=0.3)
                async with AsyncClient(grpc_server.grpc_url, transport="grpc", api_key=API_KEY, retry=retrying) as client:
                    chat = asyncio.ensure_future(client.chat("Hi", max_tokens=2))
                    await asyncio.sleep(0.5)
                    assert not chat.done()
                    held.cancel()
                    result = await asyncio.wait_for(chat, 20)
                assert result.attempts >= 2 and result.text
            finally:
                held.cancel()

    asyncio.run(main())


def test_failover_from_an_unreachable_grpc_url(grpc_server: ServerProcess) -> None:
    dead = f"grpc://127.0.0.1:{free_port()}"
    with Client(base_urls=[dead, grpc_server.grpc_url], transport="grpc", api_key=API_KEY, timeouts=Timeouts(connect_s=2.0)) as client:
        result = client.chat("Hi", max_tokens=3)
        assert result.attempts == 2 and result.base_url == grpc_server.grpc_url
        again = client.chat("Hi", max_tokens=3)  # the dead URL cools down: no second failed attempt
        assert again.attempts == 1
    with Client(dead, transport="grpc", retry=NO_RETRY) as client, pytest.raises(APIConnectionError):
        client.chat("Hi")


def test_grpc_over_tls(tls_server: ServerProcess, certs: tuple[str, str]) -> None:
    with Client(tls_server.grpc_url, transport="grpc", verify=certs[0]) as client:
        result = client.chat("Hi", max_tokens=3)
    assert tls_server.grpc_url.startswith("grpcs://") and result.usage is not None and result.usage.completion_tokens == 3


def test_transport_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="grpc://host:port"):
        Client("http://127.0.0.1:8000/v1", transport="grpc")
    with pytest.raises(ValueError, match="http:// or https://"):
        Client("grpc://127.0.0.1:50051", transport="http2")
    with pytest.raises(ValueError, match="contradicts"):
        Client("http://127.0.0.1:8000/v1", http2=True, transport="http1")
    with pytest.raises(ValueError, match="transport must be one of"):
        Client("http://127.0.0.1:8000/v1", transport="http3")  # type: ignore[arg-type]
