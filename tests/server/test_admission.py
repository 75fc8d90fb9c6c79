"""Admission control, as a unit: bounds, priorities, deadlines, queue timeouts."""

from __future__ import annotations

import asyncio

import pytest

from ember.server.admission import Admission, DrainRate
from ember.server.errors import APIError

pytestmark = pytest.mark.timeout(30)


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_full_queue_is_429_with_retry_after():
    async def main():
        rejected = []
        adm = Admission(max_running=1, max_queue=1, max_queued_tokens=10_000, on_reject=lambda r, p: rejected.append((r, p)))
        await adm.admit(1, 10, 60)  # runs
        waiting = asyncio.create_task(adm.admit(1, 10, 60))  # waits
        await asyncio.sleep(0)
        with pytest.raises(APIError) as info:
            await adm.admit(1, 10, 60)
        assert info.value.status == 429 and int(info.value.headers["Retry-After"]) >= 1
        assert rejected == [("queue_full", 1)]
        adm.release()
        await waiting
        assert adm.running == 1 and adm.num_waiting == 0

    asyncio.run(main())


def test_token_bound():
    async def main():
        adm = Admission(max_running=1, max_queue=10, max_queued_tokens=100)
        await adm.admit(1, 10, 60)
        first = asyncio.create_task(adm.admit(1, 80, 60))
        await asyncio.sleep(0)
        with pytest.raises(APIError) as info:
            await adm.admit(1, 30, 60)
        assert info.value.status == 429 and info.value.code == "rate_limit_exceeded"
        first.cancel()

    asyncio.run(main())


def test_high_priority_goes_first_and_displaces_low():
    async def main():
        order = []
        adm = Admission(max_running=1, max_queue=2, max_queued_tokens=10_000)
        await adm.admit(1, 1, 60)

        async def request(name: str, priority: int):
            try:
                await adm.admit(priority, 1, 60)
                order.append(name)
            except APIError as exc:
                order.append(f"{name}:{exc.status}")

        low1 = asyncio.create_task(request("low1", 2))
        low2 = asyncio.create_task(request("low2", 2))
        await asyncio.sleep(0)
        high = asyncio.create_task(request("high", 0))  # queue full: displaces the newest low
        await asyncio.sleep(0.01)
        assert order == ["low2:429"]
        adm.release()
        await asyncio.sleep(0.01)
        adm.release()
        await asyncio.gather(low1, low2, high)
        assert order == ["low2:429", "high", "low1"]

    asyncio.run(main())


def test_deadline_that_cannot_be_met_is_refused_at_once():
    async def main():
        clock = FakeClock()
        adm = Admission(max_running=1, max_queue=50, max_queued_tokens=10_000, clock=clock)
        adm.drain = DrainRate(clock)
        for _ in range(10):  # measured: one finish every 2 s
            clock.t += 2.0
            adm.drain.record_finish()
        await adm.admit(1, 1, 60)
        waiters = [asyncio.create_task(adm.admit(1, 1, 60)) for _ in range(5)]
        await asyncio.sleep(0)
        with pytest.raises(APIError) as info:
            await adm.admit(1, 1, deadline_in_s=3.0)  # 6 ahead at ~0.5/s: ~12 s
        assert info.value.status == 503 and "deadline" in info.value.message
        for w in waiters:
            w.cancel()

    asyncio.run(main())


def test_queued_request_whose_deadline_passes_leaves_the_queue():
    async def main():
        adm = Admission(max_running=1, max_queue=5, max_queued_tokens=10_000)
        await adm.admit(1, 1, 60)
        with pytest.raises(APIError) as info:
            await adm.admit(1, 7, deadline_in_s=0.05)
        assert info.value.status == 503 and adm.num_waiting == 0 and adm.queued_tokens == 0

    asyncio.run(main())


def test_cancelled_waiter_frees_its_place_and_granted_slot():
    async def main():
        adm = Admission(max_running=1, max_queue=5, max_queued_tokens=10_000)
        await adm.admit(1, 1, 60)
        task = asyncio.create_task(adm.admit(1, 1, 60))
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.sleep(0.01)
        assert adm.num_waiting == 0
        adm.release()
        assert adm.running == 0

    asyncio.run(main())


def test_shedding_and_per_key_limit():
    async def main():
        shed = {"on": False}
        adm = Admission(max_running=10, max_queue=5, max_queued_tokens=10_000, per_key_concurrency=1, shed_low=lambda p: shed["on"] and p >= 2)
        await adm.admit(2, 1, 60)
        shed["on"] = True
        with pytest.raises(APIError) as info:
            await adm.admit(2, 1, 60)
        assert info.value.status == 429
        await adm.admit(1, 1, 60, key="k")
        with pytest.raises(APIError):
            await adm.admit(1, 1, 60, key="k")
        adm.release("k")
        await adm.admit(1, 1, 60, key="k")

    asyncio.run(main())
