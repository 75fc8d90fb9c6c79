"""Shared by the transport tests: the test API key and a wait for the engine to let go of requests."""

from __future__ import annotations

import time

from server_process import ServerProcess, metric_value

API_KEY = "transport-test-key"


def wait_engine_idle(server: ServerProcess, within_s: float) -> float:
    """Seconds until no request runs and no KV block is referenced; fails after ``within_s``.

    Requests here carry no session id, so a finished or aborted request keeps no
    block referenced (cached prefix blocks are free to evict and not counted).
    """
    started = time.monotonic()
    while time.monotonic() - started < within_s:
        text = server.metrics()
        if metric_value(text, "llm_requests_running") == 0 and metric_value(text, "llm_kv_cache_usage_ratio") == 0:
            return time.monotonic() - started
        time.sleep(0.05)
    raise AssertionError(f"the engine still held a request after {within_s} s")
