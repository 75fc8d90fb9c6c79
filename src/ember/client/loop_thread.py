"""A private event loop on a daemon thread, which the blocking ``Client`` runs on.

The blocking client is a thin shell over the async one: every call is a
coroutine submitted here. One implementation of retries and time limits serves
both (a blocking socket read cannot be bounded by first-token / stall /
deadline limits that change while it waits, a coroutine can), and the client is
thread-safe because only this thread touches its connection pool.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """Runs coroutines on one event loop in a background thread.

    Invariant: the loop runs from construction until ``close()``; after that
    ``run`` raises ``RuntimeError``.
    """

    def __init__(self, name: str = "ember-client") -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run ``coroutine`` on the loop and block until it finishes; re-raises its exception."""
        if self._closed:
            coroutine.close()
            raise RuntimeError("the client is closed")
        if threading.current_thread() is self._thread:
            coroutine.close()
            raise RuntimeError("a blocking Client cannot be used from its own callbacks; use AsyncClient")
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result()
        except BaseException:
            # Ctrl-C (or another exception in this thread) must not leave the request running.
            future.cancel()
            raise

    def close(self) -> None:
        """Stop the loop and join its thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.run_until_complete(self._loop.shutdown_asyncgens())
        self._loop.close()
