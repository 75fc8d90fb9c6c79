"""AsyncEngine: the engine's step loop on its own thread, outputs to asyncio.

The asyncio side never touches ``LLMEngine`` state. It posts commands (add,
abort) to a thread-safe queue; the engine thread applies them at the top of each
step, so an abort frees the request's blocks within one step. After each step
the outputs are handed to each caller's event loop in one
``call_soon_threadsafe`` per loop.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Sequence

from ember.engine.engine import LLMEngine
from ember.engine.request import FinishReason, Priority, RequestOutput
from ember.engine.sampling import SamplingParams
from ember.errors import EngineDeadError

log = logging.getLogger("ember.engine")


@dataclass
class _AddCommand:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    deadline: float | None
    session_id: str | None
    arrival_time: float


@dataclass
class _CallCommand:
    fn: Callable[[LLMEngine], object]
    future: "asyncio.Future[object]"
    loop: asyncio.AbstractEventLoop


class _Stream:
    """Where one request's outputs go: an asyncio queue on the caller's loop."""

    __slots__ = ("loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()


class AsyncEngine:
    """Runs an ``LLMEngine`` in a background thread; ``generate`` is an async iterator."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._commands: queue.SimpleQueue[_AddCommand | _CallCommand | tuple[str, str, FinishReason]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wakeup = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="ember-engine", daemon=True)
        self.step_hooks: list[Callable[[LLMEngine], None]] = []
        self.last_step_time = 0.0
        self._started = False

    # -- lifecycle ---------------------------------------------------------------

    def start(self) -> None:
        if not self._started:
            self._started = True
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._started:
            self._thread.join(timeout)
        if self.engine.sessions is not None:
            self.engine.sessions.close()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # -- requests ------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        priority: int = Priority.NORMAL,
        deadline: float | None = None,
        session_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its incremental outputs until it finishes.

        Validation errors (``ContextLengthExceededError``...) are raised before
        the first output. Leaving the iterator early (a disconnected client, a
        cancelled task) aborts the request.
        """
        if not self.is_running:
            raise EngineDeadError("The engine is not running.")
        prompt = list(prompt_token_ids)
        self.engine.check_prompt(prompt, params)  # reads only immutable engine state
        stream = _Stream(asyncio.get_running_loop())
        self._streams[request_id] = stream
        self._commands.put(_AddCommand(request_id, prompt, params, int(priority), deadline, session_id, self.engine.clock()))
        self._wakeup.set()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    async def call(self, fn: Callable[[LLMEngine], object]) -> object:
        """Run ``fn(engine)`` on the engine thread between two steps; return its result."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[object] = loop.create_future()
        self._commands.put(_CallCommand(fn, future, loop))
        self._wakeup.set()
        return await future

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> None:
        """Ask the engine thread to stop a request; its blocks are freed at the next step."""
        self._commands.put(("abort", request_id, reason))
        self._wakeup.set()

    # -- the engine thread -------------------------------------------------------------

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _CallCommand):
                self._run_call(command)
            elif isinstance(command, _AddCommand):
                if command.request_id not in self._streams:
                    continue  # the caller left before the engine saw the request
                try:
                    self.engine.add_request(
                        command.request_id,
                        command.prompt_token_ids,
                        command.params,
                        priority=command.priority,
                        deadline=command.deadline,
                        session_id=command.session_id,
                        arrival_time=command.arrival_time,
                    )
                except Exception as exc:  # validation raced with a config change, duplicate id...
                    self._deliver_error(command.request_id, exc)
            else:
                _, request_id, reason = command
                out = self.engine.abort(request_id, reason)
                if out is not None:
                    self._deliver([out])

    def _run(self) -> None:
        while not self._stopping:
            self._apply_commands()
            if not self.engine.has_unfinished():
                self.engine.idle_tick()
                self._wakeup.wait(timeout=0.5)
                self._wakeup.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception:
                log.exception("engine step failed; failing the requests in flight")
                self._fail_all(EngineDeadError("The engine failed while running this request."))
                continue
            self.last_step_time = time.monotonic()
            for hook in self.step_hooks:
                hook(self.engine)
            if outputs:
                self._deliver(outputs)
            else:
                time.sleep(0.001)  # nothing schedulable (deadline sweep only): do not spin

    def _run_call(self, command: _CallCommand) -> None:
        try:
            result, error = command.fn(self.engine), None
        except Exception as exc:  # handed to the caller, not fatal for the engine
            result, error = None, exc

        def settle() -> None:
            if command.future.done():
                return
            if error is not None:
                command.future.set_exception(error)
            else:
                command.future.set_result(result)

        try:
            command.loop.call_soon_threadsafe(settle)
        except RuntimeError:
            pass  # the caller's loop is gone

    def _fail_all(self, error: BaseException) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
            self._deliver_error(request_id, error)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:
                pass  # that loop is closed; its requests are being aborted

    def _deliver_error(self, request_id: str, error: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)
            except RuntimeError:
                pass


def _put_all(items: list[tuple[_Stream, RequestOutput]]) -> None:
    for stream, out in items:
        stream.queue.put_nowait(out)
