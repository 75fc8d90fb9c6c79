"""AsyncEngine: outputs stream to asyncio; leaving early aborts within one step."""

from __future__ import annotations

import asyncio

import pytest

from ember.engine.async_engine import AsyncEngine
from helpers import greedy


@pytest.fixture(scope="module")
def core(make_engine):
    return make_engine(dtype="float32", quantization="none")


@pytest.fixture(scope="module")
def async_engine(core):
    engine = AsyncEngine(core)
    engine.start()
    yield engine
    engine.stop()


@pytest.mark.timeout(120)
def test_streams_incremental_outputs(async_engine):
    async def main():
        ids = async_engine.tokenizer.encode("Hello there")
        outs = [o async for o in async_engine.generate("a1", ids, greedy(10, ignore_eos=True))]
        return outs

    outs = asyncio.run(main())
    assert len(outs) == 10 and outs[-1].finished and not any(o.finished for o in outs[:-1])
    times = outs[-1].times
    assert times.arrival <= times.scheduled <= times.first_token <= times.finished


@pytest.mark.timeout(120)
def test_cancelling_the_consumer_frees_blocks_within_a_step(async_engine, core):
    engine = core
    idle = engine.kv.pool.num_used_blocks

    async def main():
        ids = async_engine.tokenizer.encode("Write a very long story about the sea.")
        gen = async_engine.generate("cancel-me", ids, greedy(500, ignore_eos=True))
        got = 0
        async for _ in gen:
            got += 1
            if got == 3:
                break
        await gen.aclose()
        steps_at_abort = engine.stats.steps
        for _ in range(200):
            if "cancel-me" not in engine.requests:
                break
            await asyncio.sleep(0.005)
        return steps_at_abort

    steps_at_abort = asyncio.run(main())
    assert "cancel-me" not in engine.requests
    assert engine.stats.steps - steps_at_abort <= 1
    assert engine.kv.pool.num_used_blocks == idle


@pytest.mark.timeout(120)
def test_validation_errors_raise_before_any_output(async_engine):
    from ember.errors import ContextLengthExceededError

    async def main():
        gen = async_engine.generate("huge", [5] * 100_000, greedy(5))
        with pytest.raises(ContextLengthExceededError):
            await gen.__anext__()

    asyncio.run(main())
