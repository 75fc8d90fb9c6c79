"""Streamed answers: iterate text deltas, then read ``.result``.

::

    async with client.stream_chat(messages) as stream:
        async for delta in stream:
            print(delta, end="")
    print(stream.result.usage, stream.result.ttft_s)

The request is sent when iteration starts. Until the first delta reaches the
caller the call may still be retried (a refused connection, a 503, a stream
that broke before any text); after that, a failure is raised to the caller.
``.result`` is filled once the stream ended successfully.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ember.client.errors import EmberClientError
from ember.client.results import ChatResult, Usage, chunk_finish_reason, chunk_text, parse_usage

if TYPE_CHECKING:
    from ember.client.call import Call
    from ember.client.loop_thread import LoopThread

ResultCallback = Callable[[ChatResult], None]


class AsyncChatStream:
    """The text deltas of one streamed chat (or completion) call, as an async iterator.

    Invariant: once ``_handed`` is True (a delta was returned by ``__anext__``)
    the call is never retried, because the caller may already have shown it.
    """

    def __init__(self, call: Call, *, on_result: ResultCallback | None = None) -> None:
        self._call = call
        self._on_result = on_result
        self._handed = False
        self._result: ChatResult | None = None
        self._deltas = self._generate()
        self._reset()

    def __aiter__(self) -> AsyncChatStream:
        return self

    async def __anext__(self) -> str:
        delta = await self._deltas.__anext__()
        self._handed = True
        return delta

    async def __aenter__(self) -> AsyncChatStream:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop reading and release the connection (safe to call twice)."""
        await self._deltas.aclose()

    async def collect(self) -> ChatResult:
        """Read the whole answer without handing out deltas, so a broken stream may still be retried."""
        async for _ in self._deltas:
            pass
        return self.result

    @property
    def result(self) -> ChatResult:
        """The complete answer; raises ``RuntimeError`` until the stream has ended successfully."""
        if self._result is None:
            raise RuntimeError("the stream has not finished yet: iterate it to the end first")
        return self._result

    @property
    def text(self) -> str:
        """The text received so far."""
        return "".join(self._parts)

    @property
    def ttft_s(self) -> float | None:
        """Seconds from the start of the call to the first text, once it arrived."""
        return None if self._first_token_at is None else self._first_token_at - self._call.started_at

    @property
    def request_id(self) -> str:
        return self._call.request_id

    def _reset(self) -> None:
        # Everything an attempt accumulates; a retry starts from scratch.
        self._parts: list[str] = []
        self._finish_reason: str | None = None
        self._usage: Usage | None = None
        self._response_id: str | None = None
        self._model: str | None = None
        self._first_token_at: float | None = None

    async def _generate(self) -> AsyncGenerator[str, None]:
        call = self._call
        while True:
            self._reset()
            try:
                async with call.attempt() as response:
                    async for chunk in call.chunks(response):
                        delta = self._absorb(chunk)
                        if delta:
                            if self._first_token_at is None:
                                self._first_token_at = call.clock()
                                call.mark_first_token()
                            yield delta
                    http_version = response.http_version
                break
            except EmberClientError as error:
                delay_s = None if self._handed else call.retry_delay(error)
                if delay_s is None:
                    raise
                await call.sleep(delay_s)
        self._result = self._build_result(http_version)
        if self._on_result is not None:
            self._on_result(self._result)

    def _absorb(self, chunk: dict[str, Any]) -> str:
        delta = chunk_text(chunk)
        if delta:
            self._parts.append(delta)
        self._finish_reason = chunk_finish_reason(chunk) or self._finish_reason
        self._usage = parse_usage(chunk.get("usage")) or self._usage
        self._response_id = self._response_id or chunk.get("id")
        self._model = self._model or chunk.get("model")
        return delta

    def _build_result(self, http_version: str) -> ChatResult:
        call = self._call
        return ChatResult(
            text=self.text,
            finish_reason=self._finish_reason,
            usage=self._usage,
            request_id=call.request_id,
            response_id=self._response_id,
            model=self._model,
            ttft_s=self.ttft_s,
            latency_s=call.clock() - call.started_at,
            attempts=call.attempts,
            base_url=call.base_url,
            http_version=http_version,
        )


class ChatStream:
    """The blocking twin of ``AsyncChatStream``, for ``Client``.

    Each ``next()`` runs one step of the async stream on the client's event-loop
    thread, so both share one implementation of retries and time limits. Use it
    as a context manager (or iterate to the end) so its connection is released.
    """

    def __init__(self, stream: AsyncChatStream, loop: LoopThread) -> None:
        self._stream = stream
        self._loop = loop

    def __iter__(self) -> ChatStream:
        return self

    def __next__(self) -> str:
        try:
            return self._loop.run(self._stream.__anext__())
        except StopAsyncIteration:
            raise StopIteration from None

    def __enter__(self) -> ChatStream:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Stop reading and release the connection (safe to call twice)."""
        self._loop.run(self._stream.aclose())

    @property
    def result(self) -> ChatResult:
        """The complete answer; raises ``RuntimeError`` until the stream has ended successfully."""
        return self._stream.result

    @property
    def text(self) -> str:
        """The text received so far."""
        return self._stream.text

    @property
    def ttft_s(self) -> float | None:
        return self._stream.ttft_s

    @property
    def request_id(self) -> str:
        return self._stream.request_id
