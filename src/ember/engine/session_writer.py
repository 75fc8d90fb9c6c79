"""Write-behind of hot conversations: a copy of their KV on disk while they stay in the pool.

A hot conversation lives only in the engine's pool; a replica that is killed
(SIGKILL, OOM, a lost machine) cannot write anything on its way out. So once a
hot conversation has been idle for ``SessionConfig.write_behind_s`` (the user
is reading the answer), the session manager hands its blocks to this writer,
which reads, packs and writes them on its own thread. The engine thread pays
for a reference on each block, nothing more (measured: a copy of a
1,000-token conversation's blocks took it 6-36 ms).

Why reading the pool from another thread is safe: the blocks a session holds
are full, so nothing writes to them, and the job holds one reference on each,
so none is freed or reused until the engine thread releases them after the job
(``Finished.blocks``): every job ends in a ``Finished``, written or not.

Who may write which file, and when (the invariants):

* Every job carries the session's *turn* (a counter the manager bumps on every
  finished turn). A job is written only if, at the moment of writing, its turn
  is still the one the manager wants on disk for that key (``wanted``); a newer
  turn or a deleted session makes an older job a no-op. A file on disk may hold
  an older turn than the pool: that is still a valid prefix of the conversation.
* All session-file writes and deletions of one process happen under
  ``file_lock`` (the manager's spills and unlinks take it too), so a delete can
  never be overtaken by a write of the same key.
* Lock order: the manager's table lock, then ``file_lock``, then the small
  ``_wanted_lock``; the writer thread takes only the last two, in that order.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ember.engine import warm_storage as ws
from ember.engine.block_pool import Block

log = logging.getLogger("ember.sessions")


@dataclass
class WriteJob:
    """One conversation state to put on disk."""

    key: str
    turn: int
    blocks: list[Block]  # referenced for the job (see the module docstring)
    token_ids: list[int]
    block_hashes: list[bytes]
    last_used_wall: float
    known_stat: tuple[int, int] | None  # the session's file as this process last saw it


@dataclass
class Finished:
    """A job done, for the engine thread: release ``blocks``; account for the file if one was written."""

    key: str
    turn: int
    blocks: list[Block]
    path: str | None = None
    stat: tuple[int, int] | None = None  # (size, mtime_ns): tells our file from one another replica wrote since
    yielded: bool = False  # not written: another replica's file holds a later use of the conversation


def file_stat(path: str) -> tuple[int, int] | None:
    """(size, mtime_ns) of ``path``, or None if it is gone."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


def newer_file_of_another(path: str, known: tuple[int, int] | None, last_used_wall: float, fingerprint: str) -> bool:
    """``path`` was written by someone else since this process saw it (``known``) and
    holds a later use of the conversation than ``last_used_wall``: it must not be
    overwritten. Replicas sharing a directory: the conversation moved to another
    replica, which served a newer turn than the state this one is about to write."""
    current = file_stat(path)
    if current is None or current == known:
        return False
    try:
        header = ws.read_header(path, fingerprint)
    except ws.CorruptSessionFile:
        return False  # nothing worth keeping
    return header.last_used_wall > last_used_wall


class SessionWriter:
    """One background thread that packs and writes hot conversations' KV (see module docstring)."""

    def __init__(
        self, directory: str, fingerprint: str, warm_format: str, pack_blocks: Callable[[list[int], str], ws.PackedKV]
    ) -> None:
        self.directory = directory
        self.pack_blocks = pack_blocks
        self.fingerprint = fingerprint
        self.warm_format = warm_format
        self.file_lock = threading.Lock()
        self._wanted: dict[str, int] = {}
        self._wanted_lock = threading.Lock()
        self._jobs: queue.Queue[WriteJob | None] = queue.Queue()
        self._results: deque[Finished] = deque()
        self._pending = 0  # jobs submitted and not finished; guarded by _done
        self._done = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="ember-session-writer", daemon=True)
        self._thread.start()

    # -- the engine thread's side ------------------------------------------------------

    def want(self, key: str, turn: int | None) -> None:
        """The turn of ``key`` that may be written from now on; None: nothing may be."""
        with self._wanted_lock:
            if turn is None:
                self._wanted.pop(key, None)
            else:
                self._wanted[key] = turn

    def submit(self, job: WriteJob) -> None:
        self.want(job.key, job.turn)
        with self._done:
            self._pending += 1
        self._jobs.put(job)

    def results(self) -> list[Finished]:
        """Jobs finished since the last call (the deque's pops are thread-safe)."""
        out: list[Finished] = []
        while self._results:
            out.append(self._results.popleft())
        return out

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every job submitted so far is written or skipped; False on timeout."""
        with self._done:
            return self._done.wait_for(lambda: self._pending == 0, timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish the queued jobs, then stop the thread."""
        self._jobs.put(None)
        self._thread.join(timeout_s)

    # -- the writer thread ------------------------------------------------------------------

    def _is_wanted(self, job: WriteJob) -> bool:
        with self._wanted_lock:
            return self._wanted.get(job.key) == job.turn

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                if self._is_wanted(job):  # skip the packing too when a newer turn came meanwhile
                    self._write(job)
                else:
                    self._results.append(Finished(job.key, job.turn, job.blocks))
            except Exception:  # a full disk must not kill the thread; the session stays hot in the pool
                log.exception("write-behind of session %r failed", job.key)
                self._results.append(Finished(job.key, job.turn, job.blocks))
            with self._done:
                self._pending -= 1
                self._done.notify_all()

    def _write(self, job: WriteJob) -> None:
        packed = self.pack_blocks([b.block_id for b in job.blocks], self.warm_format)
        with self.file_lock:
            if not self._is_wanted(job):
                self._results.append(Finished(job.key, job.turn, job.blocks))
                return
            path = os.path.join(self.directory, ws.session_file_name(job.key))
            if newer_file_of_another(path, job.known_stat, job.last_used_wall, self.fingerprint):
                self._results.append(Finished(job.key, job.turn, job.blocks, yielded=True))
                return
            path, _ = ws.write_session_file(
                self.directory, job.key, self.fingerprint, job.token_ids, job.block_hashes, packed, job.last_used_wall
            )
            # Published under the lock: whoever holds it next (a delete) sees this file.
            stat = file_stat(path)
            self._results.append(Finished(job.key, job.turn, job.blocks, path if stat else None, stat))
