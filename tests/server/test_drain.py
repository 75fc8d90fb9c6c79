"""SIGTERM drains: in-flight streams finish, new requests get 503, exit code 0."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from server_process import ServerProcess

pytestmark = pytest.mark.timeout(300)


def test_sigterm_drains_streams_then_exits_zero():
    proc = ServerProcess("--warmup-requests", "1", "--drain-timeout", "60").wait_ready()
    results: list[tuple[str, bool]] = []

    def stream(i: int) -> None:
        body = {"messages": [{"role": "user", "content": f"Count to {40 + i}."}], "stream": True, "max_tokens": 60, "ignore_eos": True}
        text, done = [], False
        with httpx.stream("POST", f"{proc.url}/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    text.append(line)
        results.append(("".join(text), done))

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # the four are streaming
    assert len(results) == 0, "requests finished before the signal; the test would prove nothing"
    proc.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    new = httpx.post(f"{proc.url}/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]}, timeout=10)
    assert new.status_code == 503 and "retry-after" in new.headers
    assert new.json()["error"]["code"] == "draining"
    assert httpx.get(f"{proc.base}/ready", timeout=5).status_code == 503
    for t in threads:
        t.join(120)
    assert len(results) == 4 and all(done for _, done in results)
    assert all(text.count('"finish_reason":"length"') == 1 for text, _ in results)
    assert proc.proc.wait(60) == 0
