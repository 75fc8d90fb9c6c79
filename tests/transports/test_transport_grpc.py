"""ember.v1.Generation with a plain grpcio client: streaming, unary, deadline, cancel, overload, errors, auth."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from ember.grpc.api import pb, pb_grpc
from ember.grpc.status import ERROR_INFO_URL, RETRY_INFO_URL
from server_process import ServerProcess, metric_value
from transport_common import API_KEY, wait_engine_idle

pytestmark = pytest.mark.timeout(120)

AUTH = (("authorization", f"Bearer {API_KEY}"),)
STORY = [pb.Message(role="user", content="Tell me a long story about a lighthouse.")]


def _grpc(server: ServerProcess, body: Callable[[pb_grpc.GenerationStub], Awaitable[Any]]) -> Any:
    """Run ``body(stub)`` on a fresh channel to ``server``'s gRPC port."""

    async def main() -> Any:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            return await body(pb_grpc.GenerationStub(channel))

    return asyncio.run(main())


def test_streaming_chat(grpc_server: ServerProcess) -> None:
    async def body(stub: pb_grpc.GenerationStub) -> tuple[list[Any], Any]:
        request = pb.ChatRequest(messages=[pb.Message(role="user", content="Hi")], sampling=pb.SamplingOptions(max_tokens=12, ignore_eos=True, temperature=0))
        call = stub.Chat(request, metadata=(*AUTH, ("x-request-id", "grpc-stream-1")), timeout=60)
        chunks = [chunk async for chunk in call]
        return chunks, await call.initial_metadata()

    chunks, metadata = _grpc(grpc_server, body)
    first, last = chunks[0], chunks[-1]
    assert first.id.startswith("chatcmpl-") and first.model and not first.text  # sent on admission, before any token
    assert dict(metadata)["x-request-id"] == "grpc-stream-1"
    assert all(c.finish_reason == pb.FINISH_REASON_UNSPECIFIED and not c.HasField("usage") for c in chunks[:-1])
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    assert last.usage.completion_tokens == 12 and last.usage.max_tokens == 12
    assert last.usage.total_tokens == last.usage.prompt_tokens + 12
    assert sum(c.num_tokens for c in chunks) == 12  # every generated token is accounted for once
    assert "".join(c.text for c in chunks).strip()


def test_unary_complete(grpc_server: ServerProcess) -> None:
    async def body(stub: pb_grpc.GenerationStub) -> Any:
        request = pb.CompleteRequest(prompt="The capital of France is", sampling=pb.SamplingOptions(max_tokens=6, temperature=0))
        return await stub.Complete(request, metadata=AUTH, timeout=60)

    response = _grpc(grpc_server, body)
    assert response.id.startswith("cmpl-") and response.text.strip()
    assert response.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP)
    assert 0 < response.usage.completion_tokens <= 6 and response.usage.prompt_tokens > 0


# Tokens no engine here streams within the deadline tests' 1-1.5 s (400 took 1.4 s
# on the AVX-512 VNNI kernel): the deadline, not the length, must end the call.
LONGER_THAN_ANY_DEADLINE = 1000  # under the default --max-tokens-limit (1,024)


def test_deadline_mid_generation_is_deadline_exceeded_and_frees_the_blocks(grpc_server: ServerProcess) -> None:
    async def body(stub: pb_grpc.GenerationStub) -> tuple[int, grpc.StatusCode]:
        request = pb.ChatRequest(messages=STORY, sampling=pb.SamplingOptions(max_tokens=LONGER_THAN_ANY_DEADLINE, ignore_eos=True))
        texts = 0
        try:
            async for chunk in stub.Chat(request, metadata=AUTH, timeout=1.5):
                texts += bool(chunk.text)
        except grpc.aio.AioRpcError as exc:
            return texts, exc.code()
        raise AssertionError(f"{LONGER_THAN_ANY_DEADLINE} tokens finished within 1.5 s: the deadline never bit")

    texts, code = _grpc(grpc_server, body)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert texts >= 2, "the deadline must expire mid-generation, after text was streamed"
    wait_engine_idle(grpc_server, within_s=3.0)
    statuses = [entry["status"] for entry in grpc_server.access_log() if entry["path"] == "/ember.v1.Generation/Chat"]
    assert statuses[-1] == 504, statuses  # logged as the deadline, not as a client that went away


def test_client_cancellation_aborts_the_engine_request(grpc_server: ServerProcess) -> None:
    finished_before = metric_value(grpc_server.metrics(), "llm_requests_total")

    async def body(stub: pb_grpc.GenerationStub) -> int:
        request = pb.ChatRequest(messages=STORY, sampling=pb.SamplingOptions(max_tokens=400, ignore_eos=True))
        call = stub.Chat(request, metadata=AUTH, timeout=60)
        texts = 0
        async for chunk in call:
            texts += bool(chunk.text)
            if texts == 3:
                call.cancel()
                break
        return texts

    assert _grpc(grpc_server, body) == 3
    # 400 tokens take several seconds; an aborted request leaves the engine within a step or two.
    wait_engine_idle(grpc_server, within_s=2.0)
    assert metric_value(grpc_server.metrics(), "llm_requests_total") == finished_before  # aborted, never finished


def test_overload_is_resource_exhausted_with_retry_info(grpc_server: ServerProcess) -> None:
    async def body(stub: pb_grpc.GenerationStub) -> grpc.aio.AioRpcError:
        held = stub.Chat(pb.ChatRequest(messages=STORY, sampling=pb.SamplingOptions(max_tokens=400, ignore_eos=True)), metadata=AUTH, timeout=60)
        await held.read()  # admitted: the only slot (--max-running 1 --max-queue 0) is taken
        try:
            await stub.Complete(pb.CompleteRequest(prompt="Hello"), metadata=AUTH, timeout=10)
        except grpc.aio.AioRpcError as exc:
            return exc
        finally:
            held.cancel()
        raise AssertionError("a second request was admitted past --max-running 1 --max-queue 0")

    error = _grpc(grpc_server, body)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    trailers = dict(error.trailing_metadata())
    assert int(trailers["retry-after-ms"]) >= 1000
    status = pb.RpcStatus.FromString(trailers["grpc-status-details-bin"])
    assert status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    details = {d.type_url: d.value for d in status.details}
    retry = pb.RetryInfo.FromString(details[RETRY_INFO_URL])
    assert retry.retry_delay.ToMilliseconds() == int(trailers["retry-after-ms"])
    info = pb.ErrorInfo.FromString(details[ERROR_INFO_URL])
    assert (info.reason, info.domain, info.metadata["http_status"]) == ("rate_limit_exceeded", "ember", "429")
    wait_engine_idle(grpc_server, within_s=2.0)


@pytest.mark.parametrize(
    "request_, param",
    [
        (pb.ChatRequest(messages=[pb.Message(role="user", content="Hi")], sampling=pb.SamplingOptions(temperature=5.0)), "temperature"),
        (pb.ChatRequest(messages=[pb.Message(role="user", content="Hi")], sampling=pb.SamplingOptions(max_tokens=0)), "max_tokens"),
        (pb.ChatRequest(messages=[]), "messages"),
        (pb.ChatRequest(messages=[pb.Message(role="wizard", content="Hi")]), "messages.0.role"),
        (pb.ChatRequest(messages=[pb.Message(role="user", content="Hi")], priority=9), "priority"),
    ],
)
def test_bad_arguments_are_invalid_argument(grpc_server: ServerProcess, request_: Any, param: str) -> None:
    async def body(stub: pb_grpc.GenerationStub) -> grpc.aio.AioRpcError:
        try:
            async for _ in stub.Chat(request_, metadata=AUTH, timeout=30):
                pass
        except grpc.aio.AioRpcError as exc:
            return exc
        raise AssertionError("accepted")

    error = _grpc(grpc_server, body)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = pb.RpcStatus.FromString(dict(error.trailing_metadata())["grpc-status-details-bin"])
    info = pb.ErrorInfo.FromString(next(d.value for d in status.details if d.type_url == ERROR_INFO_URL))
    assert info.metadata["http_status"] == "400" and info.metadata["param"] == param


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer wrong-key"),)], ids=["missing", "wrong"])
def test_a_missing_or_wrong_key_is_unauthenticated(grpc_server: ServerProcess, metadata: tuple[tuple[str, str], ...]) -> None:
    async def body(stub: pb_grpc.GenerationStub) -> grpc.StatusCode:
        try:
            await stub.Complete(pb.CompleteRequest(prompt="Hello"), metadata=metadata, timeout=10)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        raise AssertionError("served without a valid key")

    assert _grpc(grpc_server, body) == grpc.StatusCode.UNAUTHENTICATED


def test_reflection_lists_the_services(grpc_server: ServerProcess) -> None:
    async def body(stub: pb_grpc.GenerationStub) -> set[str]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_server.grpc_port}") as channel:
            reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            async for response in reflection.ServerReflectionInfo(iter([request])):
                return {s.name for s in response.list_services_response.service}
        return set()

    services = _grpc(grpc_server, body)
    assert {"ember.v1.Generation", "grpc.health.v1.Health"} <= services
