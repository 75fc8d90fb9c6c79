"""Load shapes without a server: Poisson arrival statistics, closed/open loops and conversations."""

from __future__ import annotations

import asyncio
import statistics

import pytest

from ember.bench.loadgen import poisson_arrival_times, run_closed_loop, run_conversations, run_open_loop
from ember.bench.record import Clock, RequestRecord
from ember.bench.workloads import Conversation, RequestSpec, story_requests

pytestmark = pytest.mark.timeout(30)


class FakeSender:
    """A ``send`` that takes ``delay_s`` per request and tracks how many were in flight."""

    def __init__(self, clock: Clock, delay_s: float) -> None:
        self.clock = clock
        self.delay_s = delay_s
        self.in_flight = 0
        self.max_in_flight = 0
        self.specs: list[RequestSpec] = []

    async def send(self, spec: RequestSpec, index: int, scheduled_s: float | None = None) -> RequestRecord:
        self.specs.append(spec)
        start = self.clock()
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(self.delay_s)
        self.in_flight -= 1
        end = self.clock()
        return RequestRecord(index=index, start_s=start, scheduled_s=start if scheduled_s is None else scheduled_s,
                             end_s=end, chunk_times_s=[end], output_tokens=1, output_text=f"reply {index}",
                             turn=spec.turn, conversation_id=spec.conversation_id, session_id=spec.session_id)


def test_poisson_inter_arrival_statistics():
    times = list(poisson_arrival_times(10.0, seed=7, max_requests=5000))
    assert len(times) == 5000 and times[0] == 0.0
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert min(gaps) > 0
    # Exponential gaps: mean 1/rate, standard deviation equal to the mean (coefficient of variation 1).
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(0.1, rel=0.05)
    assert statistics.stdev(gaps) / mean == pytest.approx(1.0, rel=0.08)
    # An exponential's median is ln 2 / rate, well below its mean.
    assert statistics.median(gaps) == pytest.approx(0.0693, rel=0.08)


def test_poisson_is_seeded_and_bounded_by_duration():
    first = list(poisson_arrival_times(5.0, seed=1, max_requests=50))
    assert first == list(poisson_arrival_times(5.0, seed=1, max_requests=50))
    assert first != list(poisson_arrival_times(5.0, seed=2, max_requests=50))
    timed = list(poisson_arrival_times(20.0, seed=3, duration_s=50.0))
    assert max(timed) < 50.0
    assert len(timed) == pytest.approx(20.0 * 50.0, rel=0.1)
    both = list(poisson_arrival_times(20.0, seed=3, max_requests=10, duration_s=50.0))
    assert both == timed[:10]
    with pytest.raises(ValueError):
        next(poisson_arrival_times(1.0, seed=0))  # unbounded
    with pytest.raises(ValueError):
        next(poisson_arrival_times(0.0, seed=0, max_requests=1))


def test_closed_loop_keeps_concurrency_and_stops_at_count():
    async def main() -> None:
        clock = Clock()
        fake = FakeSender(clock, delay_s=0.01)
        run = await run_closed_loop(fake.send, story_requests(8, ignore_eos=False), concurrency=3, clock=clock, max_requests=10)
        assert [r.index for r in run.records] == list(range(10))
        assert fake.max_in_flight == 3
        # 10 requests of 10 ms, 3 at a time: one worker sends 4 of them in a row (asyncio may wake 1 ms early).
        assert run.duration_s >= 0.035
        assert all(r.start_s >= run.start_s and r.end_s <= run.end_s for r in run.records)

    asyncio.run(main())


def test_closed_loop_stops_starting_requests_at_the_duration():
    async def main() -> None:
        clock = Clock()
        fake = FakeSender(clock, delay_s=0.02)
        run = await run_closed_loop(fake.send, story_requests(8, ignore_eos=False), concurrency=2, clock=clock, duration_s=0.1)
        assert len(run.records) >= 2
        assert all(r.start_s < run.start_s + 0.1 for r in run.records)
        # In-flight requests finish after the deadline, and the run lasts until they do.
        assert run.end_s >= max(r.end_s for r in run.records)

    asyncio.run(main())


def test_open_loop_does_not_wait_for_replies():
    async def main() -> None:
        clock = Clock()
        fake = FakeSender(clock, delay_s=0.2)
        run = await run_open_loop(fake.send, story_requests(8, ignore_eos=False), rate=100.0, seed=5, clock=clock, max_requests=12)
        assert [r.index for r in run.records] == list(range(12))
        # Mean gap 10 ms, each reply 200 ms: a closed loop of 1 would never overlap, an open loop must.
        assert fake.max_in_flight > 3
        planned = [run.start_s + t for t in poisson_arrival_times(100.0, seed=5, max_requests=12)]
        assert [r.scheduled_s for r in run.records] == pytest.approx(planned)
        assert all(0 <= r.start_s - r.scheduled_s < 0.5 for r in run.records)

    asyncio.run(main())


def test_conversations_grow_their_history():
    async def main() -> None:
        clock = Clock()
        fake = FakeSender(clock, delay_s=0.0)
        chats = [Conversation(i, system_words=10, seed=0, run_id="t") for i in range(2)]
        run = await run_conversations(fake.send, chats, turns=3, max_tokens=4, clock=clock, think_time_s=0.01)
        assert len(run.records) == 6
        assert sorted((r.conversation_id, r.turn) for r in run.records) == [(c, t) for c in (0, 1) for t in (1, 2, 3)]
        by_conversation = {c: [s for s in fake.specs if s.conversation_id == c] for c in (0, 1)}
        for conversation, specs in by_conversation.items():
            # system + (user, assistant) * (turn - 1) + user
            assert [len(s.messages) for s in specs] == [2, 4, 6]
            assert specs[1].messages[:2] == specs[0].messages
            # The reply of turn 1 (request index conversation * turns) is in the history of turn 2.
            assert specs[1].messages[2] == {"role": "assistant", "content": f"reply {conversation * 3}"}
            assert {s.headers()["X-Session-ID"] for s in specs} == {f"bench-t-{conversation}"}
        # Two conversations never share a system prompt (each starts cold).
        assert by_conversation[0][0].messages[0] != by_conversation[1][0].messages[0]

    asyncio.run(main())
