"""AsyncEngine: the engine's step loop on its own thread, and the façade servers use.

The engine thread owns ``LLMEngine``: it builds it (so that it is the only
thread running parallel compute, see ``compute_threads``), runs its steps and
applies commands. Nothing else touches engine state. Callers on asyncio loops:

* post commands (add, abort, typed admin commands) to a thread-safe queue; the
  engine thread applies them at the top of each step, so an abort frees the
  request's blocks within one step;
* receive outputs: after each step, one ``call_soon_threadsafe`` per loop;
* read ``snapshot``: a frozen ``EngineSnapshot`` the engine thread publishes
  after every step (and while idle), and ``info``, fixed once loaded.

Servers import this façade through ``ember.engine.api`` and nothing else of the
engine (tested by ``tests/server/test_engine_boundary.py``).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ember.config import EngineConfig, SessionConfig
from ember.engine import compute_threads
from ember.engine.constraints import Constraint, GrammarSpec
from ember.engine.engine import LLMEngine
from ember.engine.request import FinishReason, Priority, RequestOutput
from ember.engine.sampling import SamplingParams
from ember.engine.stats import EngineInfo, EngineSnapshot
from ember.errors import EngineDeadError
from ember.model.tokenizer import Tokenizer

log = logging.getLogger("ember.engine")

# How often the session tables are walked for the snapshot (a step is 5-50 ms;
# the counts move once per finished turn, and scrapes come every few seconds).
_SESSION_STATS_PERIOD_S = 0.25
# How long the idle loop sleeps when nothing runs and no command arrives.
_IDLE_WAIT_S = 0.5


@dataclass
class _AddCommand:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    deadline: float | None
    session_id: str | None
    arrival_time: float
    constraint: Constraint | None = None
    prediction: list[int] | None = None


@dataclass
class _CallCommand:
    fn: Callable[[LLMEngine], object]
    future: asyncio.Future[object]
    loop: asyncio.AbstractEventLoop


@dataclass
class _AbortCommand:
    request_id: str | None  # None: every request in flight
    reason: FinishReason


_Command = _AddCommand | _CallCommand | _AbortCommand


class _Stream:
    """Where one request's outputs go: an asyncio queue on the caller's loop."""

    __slots__ = ("loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()


class AsyncEngine:
    """Runs an ``LLMEngine`` on a background thread; ``generate`` is an async iterator.

    Give it a factory (the engine is then built on the engine thread: the fast
    arrangement) or an engine built elsewhere (tests that share one model).
    """

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine]) -> None:
        if isinstance(engine, LLMEngine):
            self._core: LLMEngine | None = engine
            self._factory: Callable[[], LLMEngine] | None = None
        else:
            self._core, self._factory = None, engine
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wakeup = threading.Event()
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="ember-engine", daemon=True)
        self._started = False
        self._snapshot = EngineSnapshot()
        self._info: EngineInfo | None = None
        self._sessions_read_at = float("-inf")
        self.last_step_time = 0.0

    @classmethod
    def for_model(
        cls, model: str | None, config: EngineConfig, sessions: SessionConfig | None = None, *, chat_template: str | None = None
    ) -> AsyncEngine:
        """An engine (not started) that loads ``model`` on its own thread when started
        (``chat_template``: a Jinja template replacing the model's own)."""

        def build() -> LLMEngine:
            core = LLMEngine(model, config, sessions=sessions)
            if chat_template is not None:
                core.tokenizer.set_chat_template(chat_template)
            return core

        return cls(build)

    # -- lifecycle ---------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread and wait until the engine is built (re-raises a build error).

        Blocks: from asyncio, use ``start_async``.
        """
        if not self._started:
            self._started = True
            self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            raise self._build_error

    async def start_async(self) -> None:
        """``start`` without blocking the loop; then confines the loop's thread to one torch thread."""
        await asyncio.to_thread(self.start)
        if self._factory is not None:
            # The engine thread claimed the compute threads; everything else runs torch
            # single-threaded from now on (see compute_threads for why it matters).
            compute_threads.confine_other_threads()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._started:
            self._thread.join(timeout)
        if self._core is not None and self._core.sessions is not None:
            self._core.sessions.close()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping and self._core is not None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # -- what callers may read ---------------------------------------------------

    @property
    def _engine(self) -> LLMEngine:
        if self._core is None:
            raise EngineDeadError("The engine is not built yet.")
        return self._core

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise EngineDeadError("The engine is not built yet.")
        return self._info

    @property
    def tokenizer(self) -> Tokenizer:
        return self._engine.tokenizer

    @property
    def snapshot(self) -> EngineSnapshot:
        """The latest state the engine thread published (a frozen object)."""
        return self._snapshot

    def clock(self) -> float:
        """The engine's clock (deadlines and request times are on it)."""
        return self._engine.clock()

    def check_prompt(self, prompt: list[int], params: SamplingParams) -> None:
        """Raise the engine's error for a prompt it would refuse (reads only fixed engine state)."""
        self._engine.check_prompt(prompt, params)

    def compile_grammar(self, spec: GrammarSpec, param: str) -> Constraint:
        """A fresh constraint for one request (compiled once per spec and cached; safe on any thread)."""
        return self._engine.grammar.compile(spec, param)

    def warm_grammar(self) -> None:
        """Build the grammar compiler for this vocabulary now (~0.3 s) rather than on the first request."""
        self._engine.grammar  # noqa: B018 (the property builds it)

    def session_prompt_ids(self, session_id: str, rendered: str, encode: Callable[[str], list[int]]) -> list[int] | None:
        """Prompt ids for a session's next turn that keep the ids the model generated (None: encode it all)."""
        sessions = self._engine.sessions
        return None if sessions is None else sessions.ids.prompt_ids(session_id, rendered, encode)

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
        constraint: Constraint | None = None,
        prediction: Sequence[int] | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Submit a request and yield its incremental outputs until it finishes.

        ``constraint`` (from ``engine.grammar.compile``) is a grammar the output
        must follow; it belongs to this request alone. ``prediction``: token ids
        the answer is expected to repeat (``LLMEngine.add_request``).

        Validation errors (``ContextLengthExceededError``...) are raised before
        the first output. Leaving the iterator early (a disconnected client, a
        cancelled task) aborts the request.
        """
        if not self.is_running:
            raise EngineDeadError("The engine is not running.")
        prompt = list(prompt_token_ids)
        self.check_prompt(prompt, params)
        stream = _Stream(asyncio.get_running_loop())
        self._streams[request_id] = stream
        self._post(
            _AddCommand(
                request_id,
                prompt,
                params,
                int(priority),
                deadline,
                session_id,
                self.clock(),
                constraint,
                list(prediction) if prediction else None,
            )
        )
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

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> None:
        """Ask the engine thread to stop a request; its blocks are freed at the next step."""
        self._post(_AbortCommand(request_id, reason))

    def abort_all(self) -> None:
        """Stop every request in flight (a drain that ran out of time)."""
        self._post(_AbortCommand(None, FinishReason.ABORT))

    # -- typed commands (run on the engine thread between two steps) ---------------

    async def set_prefill_chunk_tokens(self, tokens: int) -> None:
        """The per-step token budget from now on (smaller chunks protect running streams)."""

        def apply(core: LLMEngine) -> None:
            core.scheduler.max_num_batched_tokens = tokens

        await self._call(apply)

    async def reset_prefix_cache(self) -> None:
        """Drop every unreferenced cached block."""
        await self._call(lambda core: core.kv.pool.reset_prefix_cache())

    async def persist_sessions(self) -> int:
        """Write hot and RAM-warm sessions to the session directory; returns how many."""
        return await self._call(lambda core: core.sessions.persist_all() if core.sessions is not None else 0)

    async def list_sessions(self, prefix: str = "") -> list[dict[str, Any]] | None:
        """Every session whose key starts with ``prefix`` (None: sessions are disabled)."""
        return await self._call(lambda core: core.sessions.list_sessions(prefix) if core.sessions is not None else None)

    async def get_session(self, key: str) -> dict[str, Any] | None:
        return await self._call(lambda core: core.sessions.info(key) if core.sessions is not None else None)

    async def delete_session(self, key: str) -> bool:
        """Forget a session in every tier; False if it did not exist."""
        return await self._call(lambda core: core.sessions.delete(key) if core.sessions is not None else False)

    async def _call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[object] = loop.create_future()
        self._post(_CallCommand(fn, future, loop))
        return await future

    def _post(self, command: _Command) -> None:
        self._commands.put(command)
        self._wakeup.set()

    # -- the engine thread -------------------------------------------------------------

    def _run(self) -> None:
        if self._factory is not None:
            try:
                self._core = self._factory()
            except BaseException as exc:  # handed to start()
                self._build_error = exc
                self._built.set()
                return
        core = self._core
        assert core is not None
        self._info = core.info()  # on this thread: it reads this thread's torch settings
        self._publish(core)
        self._built.set()
        while not self._stopping:
            self._apply_commands(core)
            if not core.has_unfinished():
                core.idle_tick()
                self._publish(core)
                self._wakeup.wait(timeout=_IDLE_WAIT_S)
                self._wakeup.clear()
                continue
            try:
                outputs = core.step()
            except Exception:
                log.exception("engine step failed; failing the requests in flight")
                self._fail_all(core, EngineDeadError("The engine failed while running this request."))
                continue
            self.last_step_time = time.monotonic()
            self._publish(core)
            if outputs:
                self._deliver(outputs)
            else:
                time.sleep(0.001)  # nothing schedulable (deadline sweep only): do not spin

    def _publish(self, core: LLMEngine) -> None:
        now = time.monotonic()
        fresh_sessions = now - self._sessions_read_at >= _SESSION_STATS_PERIOD_S
        snapshot = core.snapshot(with_sessions=fresh_sessions)
        if fresh_sessions:
            self._sessions_read_at = now
        else:
            previous = self._snapshot
            snapshot = replace(
                snapshot,
                session_counts=previous.session_counts,
                session_bytes=previous.session_bytes,
                session_events=previous.session_events,
            )
        self._snapshot = snapshot  # one reference store: readers see the old or the new object

    def _apply_commands(self, core: LLMEngine) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _CallCommand):
                self._run_call(core, command)
            elif isinstance(command, _AddCommand):
                if command.request_id not in self._streams:
                    continue  # the caller left before the engine saw the request
                try:
                    core.add_request(
                        command.request_id,
                        command.prompt_token_ids,
                        command.params,
                        priority=command.priority,
                        deadline=command.deadline,
                        session_id=command.session_id,
                        arrival_time=command.arrival_time,
                        constraint=command.constraint,
                        prediction=command.prediction,
                    )
                except Exception as exc:  # validation raced with a config change, duplicate id...
                    self._deliver_error(command.request_id, exc)
            else:
                ids = list(core.requests) if command.request_id is None else [command.request_id]
                finals = [out for out in (core.abort(i, command.reason) for i in ids) if out is not None]
                if finals:
                    self._deliver(finals)

    def _run_call(self, core: LLMEngine, command: _CallCommand) -> None:
        try:
            result, error = command.fn(core), None
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

    def _fail_all(self, core: LLMEngine, error: BaseException) -> None:
        for request_id in list(core.requests):
            core.abort(request_id)
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
