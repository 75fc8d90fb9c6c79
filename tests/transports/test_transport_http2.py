"""`ember serve --http2`: the same SSE streams over HTTP/2 (h2c and TLS/ALPN), HTTP/1.1 on the same port."""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from typing import Any

import httpx
import pytest

from server_process import ServerProcess

pytestmark = pytest.mark.timeout(180)

STREAMS = 50


def _body(i: int, max_tokens: int = 8) -> dict[str, Any]:
    # A deadline as long as the client's: these tests are about the transport, and under the
    # default 10 s a slow CPU (2 GHz, AVX2) ends the last of fifty prompts before its first token.
    return {
        "messages": [{"role": "user", "content": f"Count from {i} upwards."}],
        "stream": True,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "timeout": 120,
    }


async def _stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], times: dict[str, float], trace: Any = None
) -> tuple[httpx.Response, list[dict[str, Any]], bool]:
    """POST a streaming chat; returns the response, its JSON events and whether [DONE] ended it."""
    events: list[dict[str, Any]] = []
    done = False
    extensions = {"trace": trace} if trace is not None else {}
    async with client.stream("POST", f"{url}/chat/completions", json=body, extensions=extensions) as response:
        times["headers"] = time.monotonic()
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                events.append(json.loads(line[6:]))
    times["end"] = time.monotonic()
    return response, events, done


def test_fifty_concurrent_streams_share_one_http2_connection(h2_server: ServerProcess) -> None:
    connects: list[str] = []

    async def trace(name: str, info: dict[str, Any]) -> None:
        if name == "connection.connect_tcp.complete":
            connects.append(name)

    times = [dict[str, float]() for _ in range(STREAMS)]

    async def main() -> list[tuple[httpx.Response, list[dict[str, Any]], bool]]:
        # httpx with http2=True; on cleartext it speaks h2c with prior knowledge only with HTTP/1.1 off.
        async with httpx.AsyncClient(http1=False, http2=True, timeout=120) as client:
            return await asyncio.gather(*(_stream(client, h2_server.url, _body(i), times[i], trace) for i in range(STREAMS)))

    results = asyncio.run(main())
    assert len(connects) == 1, f"expected one TCP connection for {STREAMS} streams, saw {len(connects)}"
    for response, events, done in results:
        assert response.status_code == 200 and response.http_version == "HTTP/2"
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["cache-control"] == "no-cache"
        assert "connection" not in response.headers  # connection-specific headers are illegal in HTTP/2
        assert done
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert any(e["choices"][0]["delta"].get("content") for e in events[1:])
    # They were in flight together: every stream had its headers before the first one ended.
    assert max(t["headers"] for t in times) < min(t["end"] for t in times)


def test_http1_is_still_served_on_the_http2_port(h2_server: ServerProcess) -> None:
    async def main() -> tuple[httpx.Response, list[dict[str, Any]], bool]:
        async with httpx.AsyncClient(timeout=60) as client:  # HTTP/1.1 only
            return await _stream(client, h2_server.url, _body(1, 4), {})

    response, events, done = asyncio.run(main())
    assert response.http_version == "HTTP/1.1" and response.status_code == 200
    assert response.headers["connection"] == "keep-alive"
    assert done and events[-1]["choices"][0]["finish_reason"] == "length"


def test_tls_negotiates_http2_by_alpn_and_http1_still_works(tls_server: ServerProcess, certs: tuple[str, str]) -> None:
    async def main(http2: bool) -> tuple[httpx.Response, list[dict[str, Any]], bool]:
        async with httpx.AsyncClient(http2=http2, verify=ssl.create_default_context(cafile=certs[0]), timeout=60) as client:
            return await _stream(client, tls_server.url, _body(2, 4), {})

    for http2, version in ((True, "HTTP/2"), (False, "HTTP/1.1")):
        response, events, done = asyncio.run(main(http2))
        assert response.status_code == 200 and response.http_version == version
        assert done and events[-1]["choices"][0]["finish_reason"] == "length"
