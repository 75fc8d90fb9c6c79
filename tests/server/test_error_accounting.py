"""Server errors are counted and logged once, including those a real model cannot be made to raise on cue.

The real app (``create_app`` on a real engine and the embedded model) runs
under real uvicorn on a real socket, in this process, so the test can inject
a fault where production would meet one and read every log record the
process writes: a failing engine step (the engine thread fails the requests
in flight, as after a kernel error or an out-of-memory) and a bug on a
request's path before the reply starts (the tokenizer raising, as it did on
a lone surrogate). Everything between the fault and the client is the
production code.
"""

from __future__ import annotations

import gc
import json
import logging
import threading
import time

import httpx
import pytest
import uvicorn

from ember.config import EngineConfig, ServerConfig
from ember.server.app import create_app
from ember.server.serve import build_state
from server_process import free_port, metric_value

pytestmark = pytest.mark.timeout(300)
HELLO = [{"role": "user", "content": "Write a long story."}]


def errors_500(base: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    try:
        return metric_value(text, "llm_request_errors_total", {"code": "500"})
    except KeyError:
        return 0.0  # none yet


class Records(logging.Handler):
    """Every log record at ERROR or above, from any logger (uvicorn's included)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def live():
    state = build_state(ServerConfig(warmup_requests=1, request_timeout_s=60), EngineConfig(threads=2))
    app = create_app(state)
    port = free_port()
    # log_config=None: uvicorn leaves logging alone, so its records reach the root logger.
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, access_log=False))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while True:
        try:
            if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "in-process server never became ready"
        time.sleep(0.2)
    records = Records()
    logging.getLogger().addHandler(records)
    yield base, state, records
    logging.getLogger().removeHandler(records)
    server.should_exit = True
    thread.join(60)
    gc.unfreeze()  # the server froze this process's heap once it was ready


def test_an_error_after_the_stream_started_is_counted(live):
    base, state, records = live
    core = state.engine._core  # the engine thread's LLMEngine
    real_execute = core.runner.execute
    fail_next = threading.Event()

    def execute(sched):
        if fail_next.is_set():
            fail_next.clear()
            raise RuntimeError("injected: a step failed")
        return real_execute(sched)

    core.runner.execute = execute
    before = errors_500(base)
    lines: list[str] = []
    try:
        body = {"messages": HELLO, "stream": True, "max_tokens": 200, "ignore_eos": True}
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line:
                    continue  # the blank line that ends each event
                lines.append(line)
                if sum(ln.startswith("data: {") for ln in lines) == 4:
                    fail_next.set()  # the stream is running: break the next step
    finally:
        core.runner.execute = real_execute
    errors = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {") and '"error"' in ln]
    assert len(errors) == 1 and errors[0]["error"]["type"] == "server_error", lines[-3:]
    assert lines[-1] == "data: [DONE]"
    assert errors_500(base) == before + 1
    # The engine logs the failed step with its traceback; the stream it ended is one line, no second traceback.
    tracebacks = [r for r in records.records if r.exc_info]
    assert [r.name for r in tracebacks] == ["ember.engine"], [(r.name, r.getMessage()) for r in records.records]
    records.records.clear()


def test_an_unhandled_error_is_one_log_record_and_an_openai_500(live):
    base, state, records = live
    tokenizer = state.engine.tokenizer

    def broken(*args, **kwargs):
        raise TypeError("TextInputSequence must be str")  # what the tokenizer raised on a lone surrogate

    records.records.clear()
    tokenizer.encode_rendered = broken
    try:
        r = httpx.post(f"{base}/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2}, timeout=60)
    finally:
        del tokenizer.encode_rendered
    assert r.status_code == 500
    assert r.json() == {"error": {"message": "Internal server error.", "type": "server_error", "param": None, "code": "internal_error"}}
    assert r.headers["x-request-id"]
    # A server logs an error in the loop iteration that ends the failed exchange
    # (uvicorn did, right after the 500 was sent); once another request has been
    # answered, every record of the failed one has been written.
    assert errors_500(base) >= 1
    assert len(records.records) == 1, [(rec.name, rec.getMessage()) for rec in records.records]
    (record,) = records.records
    assert record.name == "ember.server" and record.exc_info and r.headers["x-request-id"] in record.getMessage()
    # The server is fine afterwards.
    assert httpx.post(f"{base}/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2}, timeout=60).status_code == 200
