"""``Client``: the blocking client, a thin shell over ``AsyncClient``.

Every method runs the async implementation on a private event-loop thread
(see loop_thread.py), so both clients behave the same, and a ``Client`` may be
shared by many threads: their calls run concurrently on that loop over one pool.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any, Concatenate, Literal, ParamSpec

from ember.client.async_client import AsyncClient, Messages
from ember.client.batch import BatchRequest
from ember.client.conversation import Conversation
from ember.client.loop_thread import LoopThread
from ember.client.results import ChatResult, WarmupResult
from ember.client.streaming import ChatStream, ResultCallback

P = ParamSpec("P")


def _same_options_as(
    source: Callable[Concatenate[Any, P], None],
) -> Callable[[Callable[..., None]], Callable[Concatenate[Any, P], None]]:
    """Give the decorated ``__init__`` the parameters of ``source``: to type checkers and to ``inspect.signature``."""

    def apply(init: Callable[..., None]) -> Callable[Concatenate[Any, P], None]:
        init.__signature__ = inspect.signature(source)  # type: ignore[attr-defined]
        return init

    return apply


class Client:
    """The blocking OpenAI-compatible client; same options and behaviour as ``AsyncClient``
    (including ``transport="http1" | "http2" | "grpc"``).

    ::

        with Client("http://127.0.0.1:8000/v1") as client:
            print(client.chat("Hello!").text)
            with client.stream_chat("Tell me a story") as stream:
                for delta in stream:
                    print(delta, end="")

    Close it (``close()`` or ``with``): it owns a connection pool and a thread.
    """

    @_same_options_as(AsyncClient.__init__)
    def __init__(self, *args: Any, **options: Any) -> None:
        """The options of ``AsyncClient``, one definition for both clients (type checkers and ``help()`` see them)."""
        self._loop = LoopThread()
        try:
            self._async = self._loop.run(_create_async_client(*args, **options))
        except BaseException:
            self._loop.close()
            raise

    @property
    def base_urls(self) -> tuple[str, ...]:
        return self._async.base_urls

    @property
    def transport(self) -> str:
        """The wire this client speaks: "http1", "http2" or "grpc"."""
        return self._async.transport

    def __enter__(self) -> Client:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Close every pooled connection and stop the loop thread (idempotent)."""
        if self._loop.closed:
            return
        try:
            self._loop.run(self._async.aclose())
        finally:
            self._loop.close()

    def chat(self, messages: Messages, **params: Any) -> ChatResult:
        """Send a chat and return the whole answer (see ``AsyncClient.chat``)."""
        return self._loop.run(self._async.chat(messages, **params))

    def stream_chat(self, messages: Messages, **params: Any) -> ChatStream:
        """Start a streamed chat: iterate for text deltas, then read ``.result`` (see ``AsyncClient.stream_chat``)."""
        return self._stream_chat(messages, params)

    def complete(self, prompt: str, **params: Any) -> ChatResult:
        """A legacy ``/completions`` call; returns the whole answer."""
        return self._loop.run(self._async.complete(prompt, **params))

    def batch(self, requests: Iterable[BatchRequest], *, concurrency: int = 8, **params: Any) -> list[ChatResult | Exception]:
        """Run many chats, at most ``concurrency`` at once; per-item results or errors in input order.

        Runs as coroutines on the client's loop thread (not one thread per
        request), over the same connection pool as every other call.
        """
        return self._loop.run(self._async.batch(requests, concurrency=concurrency, **params))

    def warmup(self, connections: int = 1, *, probe: Literal["models", "chat"] = "models") -> list[WarmupResult]:
        """Open pooled connections to every base URL before real traffic (see ``AsyncClient.warmup``)."""
        return self._loop.run(self._async.warmup(connections, probe=probe))

    def conversation(self, system: str | None = None, *, session_id: str | None = None, **params: Any) -> Conversation:
        """A chat that keeps its history and a session id (``X-Session-ID``)."""
        return Conversation(self, system=system, session_id=session_id, **params)

    def _stream_chat(self, messages: Messages, params: dict[str, Any], on_result: ResultCallback | None = None) -> ChatStream:
        return ChatStream(self._async._stream_chat(messages, params, on_result), self._loop)


async def _create_async_client(*args: Any, **options: Any) -> AsyncClient:
    # Built on the loop thread, where it will always be used.
    return AsyncClient(*args, **options)
