"""Overload, priorities, queue time and degradation against real servers with tiny limits.

Ordering is driven by events, never by sleeps: "running" requests are
streams the test holds open (they cannot finish until it lets them go), and
the test waits for the server to report the state it needs (``/health``:
requests waiting in admission) before the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import Awaitable, Callable

import httpx
import pytest

from server_process import ServerProcess, metric_value

pytestmark = pytest.mark.timeout(300)
STORY = [{"role": "user", "content": "Write a long story."}]
BODY = {"messages": STORY, "stream": True, "max_tokens": 24, "ignore_eos": True}
# Far longer than any test step: a held runner finishes only when the test closes it.
HOLD = {"messages": STORY, "stream": True, "max_tokens": 4000, "ignore_eos": True}


@pytest.fixture(scope="module")
def small_server():
    proc = ServerProcess("--max-running", "2", "--max-queue", "3", "--max-tokens-limit", "4000", "--warmup-requests", "1", "--request-timeout", "120").wait_ready()
    yield proc
    proc.stop()


async def until(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 90.0) -> float:
    """Wait for a condition the server reports; returns the seconds it took."""
    started = time.monotonic()
    while not await check():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)
    return time.monotonic() - started


async def admission(client: httpx.AsyncClient, proc: ServerProcess) -> dict:
    return (await client.get(f"{proc.base}/health")).json()["admission"]


class Held:
    """A streamed request held open after its first event: it stays in the engine until ``release``."""

    def __init__(self, client: httpx.AsyncClient, url: str, body: dict, headers: dict | None = None) -> None:
        self._stack = contextlib.AsyncExitStack()
        self.client, self.url, self.body, self.headers = client, url, body, headers or {}
        self.response: httpx.Response | None = None

    async def start(self) -> Held:
        self.response = await self._stack.enter_async_context(self.client.stream("POST", self.url, json=self.body, headers=self.headers))
        assert self.response.status_code == 200, await self.response.aread()
        # Kept: a line iterator left to the garbage collector closes the response.
        self._lines = self.response.aiter_lines()
        while not (await self._lines.__anext__()).startswith("data: "):
            pass  # admitted and streaming
        return self

    async def release(self) -> None:
        await self._stack.aclose()  # the client leaves: the server aborts the request and frees its slot


async def completed(client: httpx.AsyncClient, url: str, body: dict, headers: dict | None = None) -> tuple[int, str]:
    async with client.stream("POST", url, json=body, headers=headers or {}) as r:
        return r.status_code, (await r.aread()).decode()


def test_ten_times_overload_is_refused_at_once_and_the_admitted_finish(small_server):
    """50 requests against room for 5 (2 running, 3 waiting): 45 refused at once, the 5 served.

    The two running requests are held open, so nothing can leave the queue
    while the burst arrives: every one of the 45 meets a full room. Their
    server-side time (``total_s`` in the access log, first middleware to last
    byte) must be short: a refusal is cheap, and the start of a burst used to
    stall the event loop ~400 ms (a full GC over the model's heap).
    """
    url = f"{small_server.url}/chat/completions"
    before = small_server.metrics()

    async def main():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=100)) as client:
            runners = [await Held(client, url, HOLD).start() for _ in range(2)]
            waiters = [asyncio.ensure_future(completed(client, url, BODY)) for _ in range(3)]
            await until(lambda: _waiting_is(client, 3), "3 requests waiting")
            burst = await asyncio.gather(*[client.post(url, json=BODY) for _ in range(45)])
            still_waiting = (await admission(client, small_server))["waiting"]
            for runner in runners:
                await runner.release()
            return burst, still_waiting, await asyncio.gather(*waiters)

    async def _waiting_is(client: httpx.AsyncClient, n: int) -> bool:
        return (await admission(client, small_server))["waiting"] == n

    burst, still_waiting, served = asyncio.run(main())
    assert [r.status_code for r in burst] == [429] * 45
    assert all("retry-after" in r.headers and r.json()["error"]["code"] == "rate_limit_exceeded" for r in burst)
    assert still_waiting == 3  # no refusal displaced or overtook a waiter
    assert [status for status, _ in served] == [200] * 3
    assert all("[DONE]" in text for _, text in served)
    server_times = [entry["total_s"] for entry in access_entries(small_server, 429, at_least=45)]
    # 45 arrivals at once: each refusal also waits for the event loop to get
    # through the others (12-37 ms here, 2 cores shared with the engine's threads).
    assert statistics.median(server_times) < 0.05, sorted(server_times)
    assert max(server_times) < 0.25, sorted(server_times)
    after = small_server.metrics()
    assert metric_value(after, "llm_requests_rejected_total") - _or_zero(before, "llm_requests_rejected_total") >= 45
    # No collection of the oldest generation over 100 ms while serving (the model's heap is frozen).
    slow_gen2 = _or_zero(after, "llm_gc_pause_seconds_count", {"generation": "2"}) - _or_zero(
        after, "llm_gc_pause_seconds_bucket", {"generation": "2", "le": "0.1"}
    )
    assert slow_gen2 == 0


def test_high_priority_takes_the_first_free_slot(small_server):
    """Two low-priority requests wait, then a high one arrives last; one slot frees: the high one gets it."""
    url = f"{small_server.url}/chat/completions"

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            runners = [await Held(client, url, HOLD).start() for _ in range(2)]
            waiters: dict[str, Held] = {}
            tasks: dict[str, asyncio.Future] = {}
            for name, priority in (("low1", "low"), ("low2", "low"), ("high", "high")):
                waiters[name] = Held(client, url, HOLD, {"X-Priority": priority})
                tasks[name] = asyncio.ensure_future(waiters[name].start())
                n = len(tasks)
                await until(lambda n=n: _waiting_is(client, n), f"{n} waiting")
            await runners[0].release()  # exactly one slot frees
            done, _ = await asyncio.wait(tasks.values(), return_when=asyncio.FIRST_COMPLETED)
            first = next(name for name, task in tasks.items() if task in done)
            waiting_after = (await admission(client, small_server))["waiting"]
            for name, task in tasks.items():
                if task.done():
                    await waiters[name].release()
            await runners[1].release()
            for name, task in tasks.items():  # the lows get the slots now free, then leave
                await task
                await waiters[name].release()
            return first, waiting_after

    async def _waiting_is(client: httpx.AsyncClient, n: int) -> bool:
        return (await admission(client, small_server))["waiting"] == n

    first, waiting_after = asyncio.run(main())
    assert first == "high"
    assert waiting_after == 2  # both lows still waiting when the high one started


def test_queue_time_is_in_end_to_end_ttft_and_queue_histograms(small_server):
    """A request held ~1 s in the admission queue shows >= 1 s end to end, to first token and in the queue histogram."""
    url = f"{small_server.url}/chat/completions"
    before = small_server.metrics()

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            runners = [await Held(client, url, HOLD).start() for _ in range(2)]
            queued = asyncio.ensure_future(
                client.post(url, json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}, headers={"X-Request-ID": "held-in-queue"})
            )
            await until(lambda: _waiting_is(client, 1), "the request to wait")
            await asyncio.sleep(1.0)  # the quantity under test: how long it is held, not an ordering
            await runners[0].release()
            reply = await queued
            await runners[1].release()
            return reply

    async def _waiting_is(client: httpx.AsyncClient, n: int) -> bool:
        return (await admission(client, small_server))["waiting"] == n

    reply = asyncio.run(main())
    assert reply.status_code == 200, reply.text
    entry = access_entry(small_server, "held-in-queue")
    assert entry["queue_s"] >= 1.0 and entry["ttft_s"] >= 1.0 and entry["total_s"] >= 1.0, entry
    after = small_server.metrics()

    def over_one_second(text: str, name: str) -> float:
        return _or_zero(text, f"{name}_count") - _or_zero(text, f"{name}_bucket", {"le": "1.0"})

    # The held request is the only one that waited: exactly one new queue wait over 1 s.
    assert over_one_second(after, "llm_request_queue_seconds") - over_one_second(before, "llm_request_queue_seconds") == 1
    assert over_one_second(after, "llm_time_to_first_token_seconds") - over_one_second(before, "llm_time_to_first_token_seconds") >= 1
    assert over_one_second(after, "llm_request_duration_seconds") - over_one_second(before, "llm_request_duration_seconds") >= 1


# ------------------------------------------------------------------ degradation

# Short windows so the tests are quick: p99s over the last 2 s, a condition
# must hold 3 s. Queue-wait objective 0.5 s; inter-token objective 1 s (the
# test machine is shared, and token gaps are not what these tests are about).
SLO_FLAGS = ("--slo-eval-window", "2", "--slo-window", "3", "--slo-min-samples", "1", "--slo-queue-p99", "0.5", "--slo-itl-p99", "1.0")


@pytest.fixture(scope="module")
def slo_server():
    proc = ServerProcess("--max-running", "2", "--max-queue", "16", "--max-tokens-limit", "4000", "--request-timeout", "120", "--warmup-requests", "1", *SLO_FLAGS).wait_ready()
    yield proc
    proc.stop()


def _degraded(proc: ServerProcess) -> dict:
    return httpx.get(f"{proc.base}/health", timeout=10).json()["degraded"]


def test_one_client_asking_long_answers_never_degrades(slo_server):
    """Issue 14's case: one user, long answers back to back for longer than the window."""
    url = f"{slo_server.url}/chat/completions"
    assert _degraded(slo_server)["since"] is None  # a fresh server: never changed state
    # Long enough that every answer takes over a second even on the fastest kernel here (300
    # tokens took ~1.1 s on AVX-512 VNNI): the end-to-end check at the bottom depends on it.
    tokens = 600
    body = {"messages": [{"role": "user", "content": "Tell me a very long story about the sea."}], "max_tokens": tokens, "ignore_eos": True}
    longest_window = 2 * (2 + 3)  # evaluation window + window, twice over
    started, answers, e2e_p99s = time.monotonic(), 0, []
    while answers < 2 or time.monotonic() - started < longest_window:
        r = httpx.post(url, json=body, timeout=180)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == tokens, r.text
        assert "x-ember-degraded" not in r.headers and r.headers["x-ember-max-tokens"] == str(tokens)
        answers += 1
        state = _degraded(slo_server)
        e2e_p99s.append(state["p99_e2e_s"])
        assert state["degraded"] is False, state
    state = _degraded(slo_server)
    assert state["since"] is None and state["reason"] == "", state  # not even briefly
    # An end-to-end rule at the queue objective would have fired on this traffic.
    assert max(p for p in e2e_p99s if p is not None) > 1.0, e2e_p99s


def test_open_loop_load_at_twice_capacity_degrades_then_recovers(slo_server):
    url = f"{slo_server.url}/chat/completions"
    short = {"messages": STORY, "max_tokens": 16, "ignore_eos": True}

    async def main() -> dict:
        async with httpx.AsyncClient(timeout=180, limits=httpx.Limits(max_connections=200)) as client:
            # Capacity: 2 closed-loop clients (the server runs 2 at a time).
            started = time.monotonic()
            for _ in range(3):
                replies = await asyncio.gather(client.post(url, json=short), client.post(url, json=short))
                assert all(r.status_code == 200 for r in replies)
            capacity = 6 / (time.monotonic() - started)
            await until(lambda: _not_degraded(client), "recovery from the capacity run")
            statuses: list[int] = []
            in_flight: set[asyncio.Future] = set()

            async def one() -> None:
                r = await client.post(url, json=short)
                statuses.append(r.status_code)

            async def open_loop() -> None:
                interval = 1 / (2 * capacity)
                next_at = time.monotonic()
                while True:
                    task = asyncio.ensure_future(one())
                    in_flight.add(task)
                    task.add_done_callback(in_flight.discard)
                    next_at += interval
                    await asyncio.sleep(max(0.0, next_at - time.monotonic()))

            sender = asyncio.ensure_future(open_loop())
            took_to_degrade = await until(lambda: _is_degraded(client), "degradation under 2x load", timeout_s=60)
            state = (await client.get(f"{slo_server.base}/health")).json()["degraded"]
            # What degraded means, seen by clients while the load goes on.
            clamped = Held(client, url, {**HOLD, "max_tokens": 200}, {"X-Priority": "high"})
            await clamped.start()
            clamped_headers = dict(clamped.response.headers)
            await clamped.release()
            shed = await client.post(url, json={**short, "priority": "low"})
            sender.cancel()
            for task in list(in_flight):
                task.cancel()  # the clients leave; their requests are aborted
            await asyncio.gather(sender, *in_flight, return_exceptions=True)
            took_to_recover = await until(lambda: _not_degraded(client), "recovery after the load stopped", timeout_s=90)
            return dict(capacity=capacity, took_to_degrade=took_to_degrade, took_to_recover=took_to_recover, state=state,
                        clamped=clamped_headers, shed=shed, statuses=statuses)

    async def _is_degraded(client: httpx.AsyncClient) -> bool:
        return (await client.get(f"{slo_server.base}/health")).json()["degraded"]["degraded"]

    async def _not_degraded(client: httpx.AsyncClient) -> bool:
        return not await _is_degraded(client)

    out = asyncio.run(main())
    print(f"capacity {out['capacity']:.2f} req/s; degraded after {out['took_to_degrade']:.1f}s of 2x load; recovered {out['took_to_recover']:.1f}s after it stopped")
    # The condition holds within a second or two at 2x, then must hold for the 3 s window.
    assert out["took_to_degrade"] >= 3
    assert "queue" in out["state"]["reason"], out["state"]
    assert out["clamped"]["x-ember-degraded"] == "1" and out["clamped"]["x-ember-max-tokens"] == "80"
    assert out["shed"].status_code == 429 and "sheds low-priority" in out["shed"].json()["error"]["message"]
    assert out["statuses"].count(200) >= 1  # the load was served meanwhile, not only refused
    # Recovery needs the overload gone from the evaluation window, then the whole window.
    assert out["took_to_recover"] >= 3
    assert metric_value(slo_server.metrics(), "llm_degraded") == 0
    assert _degraded(slo_server)["reason"].startswith("no overload signal")


def test_the_admin_endpoint_forces_degradation(slo_server):
    url = f"{slo_server.url}/chat/completions"
    fast = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    assert httpx.post(f"{slo_server.base}/admin/degrade", json={"mode": "on"}).json()["degraded"] is True
    assert httpx.post(url, json=fast, timeout=60).headers.get("x-ember-degraded") == "1"
    assert httpx.post(url, json={**fast, "priority": "low"}, timeout=60).status_code == 429
    assert httpx.post(f"{slo_server.base}/admin/degrade", json={"mode": "auto"}).json()["forced"] is None
    assert "x-ember-degraded" not in httpx.post(url, json=fast, timeout=60).headers


def access_entry(proc: ServerProcess, request_id: str, timeout_s: float = 30.0) -> dict:
    """The access-log entry of one request; the line is written just after the reply's last byte."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for entry in proc.access_log():
            if entry["request_id"] == request_id:
                return entry
        time.sleep(0.05)
    raise AssertionError(f"no access-log entry for {request_id}")


def access_entries(proc: ServerProcess, status: int, at_least: int, timeout_s: float = 30.0) -> list[dict]:
    """At least ``at_least`` access-log entries of this status, once they are written."""
    deadline = time.monotonic() + timeout_s
    while len(entries := proc.access_log(status=status)) < at_least:
        if time.monotonic() > deadline:
            raise AssertionError(f"{len(entries)} access-log entries with status {status}, expected {at_least}")
        time.sleep(0.05)
    return entries


def _or_zero(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    try:
        return metric_value(text, name, labels)
    except KeyError:
        return 0.0  # the family has no sample yet
