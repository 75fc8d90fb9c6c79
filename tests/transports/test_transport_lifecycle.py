"""A server's life over HTTP/2 and gRPC: health NOT_SERVING while loading, SERVING when ready, draining on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ember.grpc.api import pb, pb_grpc
from ember.grpc.status import ERROR_INFO_URL
from server_process import ServerProcess

pytestmark = pytest.mark.timeout(240)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def _health(channel: grpc.aio.Channel, service: str = "") -> int | None:
    """The health status, or None while the gRPC port does not answer yet."""
    try:
        response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
    except grpc.aio.AioRpcError as exc:
        if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return None
        raise
    return response.status


async def _ready_status(client: httpx.AsyncClient, proc: ServerProcess) -> int | None:
    try:
        return (await client.get(f"{proc.base}/ready")).status_code
    except httpx.TransportError:
        return None


async def _grpc_stream(stub: pb_grpc.GenerationStub, texts: list[str]) -> Any:
    request = pb.ChatRequest(messages=[pb.Message(role="user", content="Count to fifty.")], sampling=pb.SamplingOptions(max_tokens=60, ignore_eos=True))
    last = None
    async for chunk in stub.Chat(request, timeout=120):
        texts.append(chunk.text)
        last = chunk
    return last


async def _http2_stream(client: httpx.AsyncClient, proc: ServerProcess, texts: list[str]) -> list[dict[str, Any]]:
    body = {"messages": [{"role": "user", "content": "Count to forty."}], "stream": True, "max_tokens": 60, "ignore_eos": True}
    events: list[dict[str, Any]] = []
    async with client.stream("POST", f"{proc.url}/chat/completions", json=body) as response:
        assert response.http_version == "HTTP/2"
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                texts.append(events[-1]["choices"][0]["delta"].get("content", "") if events[-1]["choices"] else "")
    return events


def test_health_follows_readiness_and_sigterm_drains_http2_and_grpc() -> None:
    # Warm-up requests lengthen the loading phase, during which health must say NOT_SERVING.
    proc = ServerProcess("--http2", "--warmup-requests", "6", "--drain-timeout", "60", grpc=True)
    try:
        asyncio.run(_lifecycle(proc))
        assert proc.proc.wait(60) == 0
    finally:
        proc.stop()


async def _lifecycle(proc: ServerProcess) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{proc.grpc_port}") as channel, httpx.AsyncClient(http1=False, http2=True, timeout=60) as h2:
        # 1. Loading: the gRPC port answers NOT_SERVING while /ready is 503; SERVING only once /ready is 200.
        seen: list[tuple[int, int | None]] = []
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert proc.proc.poll() is None, proc.log()
            ready_before = await _ready_status(h2, proc)
            status = await _health(channel)
            if status is not None:
                seen.append((status, ready_before))
            if status == SERVING:
                break
            await asyncio.sleep(0.05)
        assert seen and seen[-1][0] == SERVING, f"never SERVING: {seen}"
        assert any(status == NOT_SERVING for status, _ in seen), "the health service was never seen NOT_SERVING while loading"
        assert all(ready in (503, None) for status, ready in seen if status == NOT_SERVING)
        assert await _ready_status(h2, proc) == 200
        assert await _health(channel, "ember.v1.Generation") == SERVING

        # 2. Two streams in flight, one per protocol.
        stub = pb_grpc.GenerationStub(channel)
        grpc_texts: list[str] = []
        h2_texts: list[str] = []
        grpc_task = asyncio.ensure_future(_grpc_stream(stub, grpc_texts))
        h2_task = asyncio.ensure_future(_http2_stream(h2, proc, h2_texts))
        while len([t for t in grpc_texts if t]) < 2 or len([t for t in h2_texts if t]) < 2:
            assert not grpc_task.done() and not h2_task.done(), "a stream ended before the signal: the test would prove nothing"
            await asyncio.sleep(0.02)

        # 3. SIGTERM: still listening, new work refused with "draining", health NOT_SERVING.
        proc.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        assert await _health(channel) == NOT_SERVING
        refused = await h2.post(f"{proc.url}/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining" and "retry-after" in refused.headers
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Complete(pb.CompleteRequest(prompt="Hi"), timeout=10)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        details = pb.RpcStatus.FromString(dict(caught.value.trailing_metadata())["grpc-status-details-bin"]).details
        assert pb.ErrorInfo.FromString(next(d.value for d in details if d.type_url == ERROR_INFO_URL)).reason == "draining"

        # 4. The streams in flight finish whole.
        last = await asyncio.wait_for(grpc_task, 60)
        assert last.finish_reason == pb.FINISH_REASON_LENGTH and last.usage.completion_tokens == 60
        events = await asyncio.wait_for(h2_task, 60)
        assert events[-1]["choices"][0]["finish_reason"] == "length"
