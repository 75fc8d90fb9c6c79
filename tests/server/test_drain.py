"""SIGTERM drains: in-flight streams finish, new requests get 503, exit code 0.

Driven by events: the signal is sent once every stream has received tokens,
and the new request once the server says it is draining (``/ready`` 503). The
streams are long (400 tokens, seconds of work) so that they are still
running when the new request arrives; the test checks that rather than
assuming it.
"""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from server_process import ServerProcess

pytestmark = pytest.mark.timeout(300)
STREAMS = 4
CHUNKS_BEFORE_SIGNAL = 5


def test_sigterm_drains_streams_then_exits_zero():
    proc = ServerProcess("--warmup-requests", "1", "--drain-timeout", "120", "--request-timeout", "120").wait_ready()
    results: list[tuple[str, bool]] = []
    streaming = [threading.Event() for _ in range(STREAMS)]

    def stream(i: int) -> None:
        body = {"messages": [{"role": "user", "content": f"Count to {40 + i}."}], "stream": True, "max_tokens": 400, "ignore_eos": True}
        text, done, chunks = [], False, 0
        with httpx.stream("POST", f"{proc.url}/chat/completions", json=body, timeout=180) as r:
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    text.append(line)
                    chunks += 1
                    if chunks == CHUNKS_BEFORE_SIGNAL:
                        streaming[i].set()
        results.append(("".join(text), done))

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
    try:
        for t in threads:
            t.start()
        for event in streaming:
            assert event.wait(120), "a stream never started"
        proc.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while httpx.get(f"{proc.base}/ready", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "the server never reported draining"
            time.sleep(0.02)
        new = httpx.post(f"{proc.url}/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]}, timeout=10)
        assert len(results) == 0, "streams finished before the new request; the test would prove nothing"
        assert new.status_code == 503 and "retry-after" in new.headers
        assert new.json()["error"]["code"] == "draining"
        for t in threads:
            t.join(180)
        assert len(results) == STREAMS and all(done for _, done in results)
        assert all(text.count('"finish_reason":"length"') == 1 for text, _ in results)
        assert proc.proc.wait(60) == 0
    finally:
        proc.stop()
