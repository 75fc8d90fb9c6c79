"""Load shapes: closed loop, open loop (Poisson arrivals) and concurrent conversations.

- Closed loop: ``concurrency`` workers each send a request, wait for its end,
  and send the next. The offered load adapts to the server, so latency can
  never run away; by Little's law throughput ≈ concurrency / mean latency.
- Open loop: requests arrive at Poisson times at ``rate`` per second whatever
  the server does (as users do), so an overloaded server shows queueing.
- Conversations: N chats run concurrently, each sending its turns one after
  the other with an optional think time between them.

Every runner stops starting requests once ``max_requests`` were started or
``duration_s`` has passed (whichever comes first), then waits for the ones in
flight; the run's duration therefore ends when the last request ends.

The functions take a ``send`` callable (``Sender.send`` or a fake) so they can
be reused by any benchmark, and tested without a server.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from ember.bench.record import Clock, RequestRecord
from ember.bench.workloads import Conversation, RequestSpec, SpecFactory

OnRecord = Callable[[RequestRecord], None]


class SendFn(Protocol):
    """Sends one request and returns its record (``Sender.send``)."""

    def __call__(self, spec: RequestSpec, index: int, scheduled_s: float | None = None) -> Awaitable[RequestRecord]: ...


@dataclass
class RunResult:
    """The records of one run, ordered by request index, and when the run started and ended."""

    records: list[RequestRecord]
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


def _check_bounds(max_requests: int | None, duration_s: float | None) -> None:
    if max_requests is None and duration_s is None:
        raise ValueError("a run needs max_requests, duration_s or both")
    if max_requests is not None and max_requests < 0:
        raise ValueError("max_requests must be >= 0")
    if duration_s is not None and duration_s <= 0:
        raise ValueError("duration_s must be > 0")


def poisson_arrival_times(rate: float, *, seed: int, max_requests: int | None = None, duration_s: float | None = None) -> Iterator[float]:
    """Arrival times in seconds of a Poisson process at ``rate`` per second.

    The first request arrives at 0 (the run starts with work); each later one
    after an exponential gap of mean ``1 / rate`` drawn from ``random.Random(seed)``.
    Stops after ``max_requests`` arrivals or at the first arrival at or after ``duration_s``.
    """
    if rate <= 0:
        raise ValueError("rate must be > 0 requests per second")
    _check_bounds(max_requests, duration_s)
    rng = random.Random(seed)
    at, count = 0.0, 0
    while (max_requests is None or count < max_requests) and (duration_s is None or at < duration_s):
        yield at
        count += 1
        at += rng.expovariate(rate)


async def run_closed_loop(
    send: SendFn,
    make_spec: SpecFactory,
    *,
    concurrency: int,
    clock: Clock,
    max_requests: int | None = None,
    duration_s: float | None = None,
    on_record: OnRecord | None = None,
) -> RunResult:
    """Keep ``concurrency`` requests in flight until the bounds are reached."""
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    _check_bounds(max_requests, duration_s)
    start_s = clock()
    deadline_s = start_s + duration_s if duration_s is not None else math.inf
    records: list[RequestRecord] = []
    next_index = 0

    async def worker() -> None:
        nonlocal next_index
        # No await between the checks and the increment: workers never take the same index.
        while (max_requests is None or next_index < max_requests) and clock() < deadline_s:
            index = next_index
            next_index += 1
            record = await send(make_spec(index), index)
            records.append(record)
            if on_record is not None:
                on_record(record)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return RunResult(sorted(records, key=lambda r: r.index), start_s, clock())


async def run_open_loop(
    send: SendFn,
    make_spec: SpecFactory,
    *,
    rate: float,
    seed: int,
    clock: Clock,
    max_requests: int | None = None,
    duration_s: float | None = None,
    on_record: OnRecord | None = None,
) -> RunResult:
    """Send requests at Poisson arrival times, never waiting for earlier ones to finish.

    Each record's ``scheduled_s`` is its planned arrival; ``start_s - scheduled_s``
    is how late the client was (it should stay near 0, else the client is the bottleneck).
    """
    arrivals = poisson_arrival_times(rate, seed=seed, max_requests=max_requests, duration_s=duration_s)
    start_s = clock()
    records: list[RequestRecord] = []

    async def one(index: int, scheduled_s: float) -> None:
        record = await send(make_spec(index), index, scheduled_s)
        records.append(record)
        if on_record is not None:
            on_record(record)

    tasks: list[asyncio.Task[None]] = []
    for index, offset_s in enumerate(arrivals):
        delay_s = start_s + offset_s - clock()
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        tasks.append(asyncio.create_task(one(index, start_s + offset_s)))
    await asyncio.gather(*tasks)
    return RunResult(sorted(records, key=lambda r: r.index), start_s, clock())


async def run_conversations(
    send: SendFn,
    conversations: list[Conversation],
    *,
    turns: int,
    max_tokens: int,
    clock: Clock,
    ignore_eos: bool = False,
    think_time_s: float = 0.0,
    group: str = "",
    on_record: OnRecord | None = None,
) -> RunResult:
    """Run every conversation concurrently for ``turns`` turns each.

    A turn's request holds the whole history so far; its reply is appended
    before the next user message, after ``think_time_s`` of "user reading".
    """
    start_s = clock()
    records: list[RequestRecord] = []

    async def chat(conversation: Conversation) -> None:
        for turn in range(turns):
            if turn > 0 and think_time_s > 0:
                await asyncio.sleep(think_time_s)
            spec = conversation.next_request(max_tokens, ignore_eos=ignore_eos, group=group)
            index = conversation.conversation_id * turns + turn
            record = await send(spec, index)
            conversation.add_reply(record.output_text)
            records.append(record)
            if on_record is not None:
                on_record(record)

    await asyncio.gather(*(chat(c) for c in conversations))
    return RunResult(sorted(records, key=lambda r: r.index), start_s, clock())
