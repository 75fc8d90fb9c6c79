"""``--trace-memory``: a request's figure is the process's peak while it was in flight, whatever else runs.

Request A carries an 8 MB body (an ignored field: parsing it allocates
transient copies beyond what stays alive) and streams for a while; request B,
small, starts once A is streaming and ends before it. tracemalloc's peak is
process-wide: resetting it at B's start (what an earlier version did) erased
A's parsing peak, so A reported about what was still alive at the end. Above
the figure of a small request alone (the process's resting level), A's figure
must be what it is when A runs alone, and B's (inside A's life) no larger
than A's.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from server_process import ServerProcess

pytestmark = pytest.mark.timeout(300)
PADDING = 8_000_000


@pytest.fixture(scope="module")
def traced():
    proc = ServerProcess("--trace-memory", "--max-body-bytes", str(32 * 1024 * 1024), "--warmup-requests", "1").wait_ready()
    yield proc
    proc.stop()


def peak_of(proc: ServerProcess, request_id: str) -> int:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for entry in proc.access_log():
            if entry["request_id"] == request_id:
                return entry["process_peak_python_bytes"]  # named for what it is: a process-wide figure
        time.sleep(0.05)
    raise AssertionError(f"no access-log entry for {request_id}")


def test_concurrent_requests_do_not_overwrite_each_others_peak(traced):
    url = f"{traced.url}/chat/completions"
    big = {"messages": [{"role": "user", "content": "Tell a story."}], "stream": True, "max_tokens": 60, "ignore_eos": True, "x_padding": "a" * PADDING}
    small = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

    async def stream_big(client: httpx.AsyncClient, request_id: str, during=None) -> None:
        async with client.stream("POST", url, json=big, headers={"X-Request-ID": request_id}) as r:
            assert r.status_code == 200
            lines = r.aiter_lines()
            chunks = 0
            async for line in lines:
                chunks += line.startswith("data: {")
                if chunks == 3 and during is not None:
                    reply = await during()  # B runs and ends while A streams
                    assert reply.status_code == 200
                    during = None

    async def main() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            assert (await client.post(url, json=small, headers={"X-Request-ID": "resting"})).status_code == 200
            await stream_big(client, "alone")
            await stream_big(client, "outer", lambda: client.post(url, json=small, headers={"X-Request-ID": "inner"}))

    asyncio.run(main())
    resting = peak_of(traced, "resting")
    alone, outer, inner = (peak_of(traced, rid) - resting for rid in ("alone", "outer", "inner"))
    entries = [e["request_id"] for e in traced.access_log() if e["request_id"] in ("outer", "inner")]
    assert entries == ["inner", "outer"]  # B's life was inside A's
    assert alone > PADDING, (resting, alone)  # the body's parse is in the figure
    assert outer >= 0.9 * alone, (resting, alone, outer, inner)  # B's start did not erase A's peak
    assert inner <= outer, (outer, inner)
