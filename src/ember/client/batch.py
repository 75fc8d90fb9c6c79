"""Many chat calls with bounded concurrency, each ending in a result or its own error."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, cast

from ember.client.results import ChatResult

# A message list, a plain user prompt, or a mapping of chat() keywords holding "messages".
BatchRequest = str | Sequence[Mapping[str, Any]] | Mapping[str, Any]


async def run_batch(
    chat: Callable[..., Awaitable[ChatResult]],
    requests: Iterable[BatchRequest],
    *,
    concurrency: int,
    params: Mapping[str, Any],
) -> list[ChatResult | Exception]:
    """Run ``chat`` for every request with at most ``concurrency`` in flight.

    Returns one entry per request, in input order: its ``ChatResult`` or the
    ``Exception`` it raised. Cancellation is not an item result: it stops the batch.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    items = list(requests)
    results: list[ChatResult | Exception | None] = [None] * len(items)
    # One shared iterator: each worker takes the next index, so no index runs twice
    # and a slow request never holds back the ones queued behind another worker.
    pending_indexes = iter(range(len(items)))

    async def worker() -> None:
        for index in pending_indexes:
            try:
                results[index] = await chat(**_chat_arguments(items[index], params))
            except Exception as error:
                results[index] = error

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(items)))))
    # Every index was taken by exactly one worker, so no entry is still None.
    return cast("list[ChatResult | Exception]", results)


def _chat_arguments(request: BatchRequest, params: Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(request, Mapping):
        if "messages" not in request:
            raise ValueError("a batch request given as a mapping needs a 'messages' key")
        return {**params, **request}
    return {**params, "messages": request}
