"""Every session file operation of a process, on one thread of its own, in submission order.

The engine thread never waits on a disk. It submits jobs and, at the top of
each step, takes back their results (``results``):

* ``WriteJob``: put a conversation's KV in its file. The source is either a
  packed RAM copy (a spill) or pool blocks the job holds a reference on (a
  write-behind of a hot conversation: this thread packs them; the blocks are
  full, so nothing writes to them, and the reference keeps them from being
  freed until the engine thread takes the ``Written`` result back).
* ``RestoreJob``: copy a conversation's warm KV into pool blocks the engine
  reserved for a waiting request, from its RAM copy or from its file (read
  and verified: checksum, model, owner). The blocks are nobody else's until
  the engine thread takes the ``Restored`` result back and caches them.
* a delete: remove a file unless another replica has rewritten it since.

Restores go before writes and deletes in the queue (a turn waits for them);
a restore that overtakes a write of the same conversation reads the older
file, which is still a valid prefix (matched block by block).

The thread runs at the engine's CPU priority on purpose: a lower one made it
hold the GIL while descheduled behind the engine's busy threads, and the
engine then waited for it (priority inversion; measured 200 ms step gaps).
Its heavy parts (file I/O, checksum, packing, copies into the pool) release
the GIL (see ``warm_storage.py``).

Why one thread is enough for correctness: jobs run in the order they were
submitted, so a delete submitted after a write runs after it and a read sees
every earlier write. A write runs only if its turn is still the one the
engine wants on disk for that key (``want``): a newer turn or a deleted
session turns an older write into a no-op. Replicas sharing the directory:
a write never replaces a file another replica wrote for a later use of the
conversation (``newer_file_of_another``), and a delete spares a file whose
size or mtime changed since this process saw it.

It also keeps ``listing``, the file names in the directory (refreshed
after its own writes and deletes and every ``LISTING_PERIOD_S``), so the
engine can tell without reading the directory whether another replica left a
file for a conversation it has never seen. The listing may be up to a period
old, and a conversation moves here exactly when its replica just died, right
after writing its copy: a name the listing lacks costs one ``stat`` (a few
microseconds on a local disk), the only I/O the engine thread does here.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ember.engine import compute_threads
from ember.engine import warm_storage as ws
from ember.engine.block_pool import Block

log = logging.getLogger("ember.sessions")

LISTING_PERIOD_S = 1.0
# On two cores each CPU-bound burst of this thread stalls the engine's compute threads (they
# meet at barriers, and one of them lost its core). So a job runs in the CPU time the engine
# leaves idle (SCHED_IDLE: measured, the other stream's median step during a 55 MB restore
# went from 2.3x to 1.1-1.3x its undisturbed value). Idle time can run short under sustained
# load, so a job still unfinished after STARVED_AFTER_S runs at normal priority, sleeping as
# long as it worked after every chunk (BUSY_DUTY) while the engine is busy; so does every job
# where there is no idle class.
BUSY_DUTY = 0.5
STARVED_AFTER_S = 1.0


def file_stat(path: str) -> tuple[int, int] | None:
    """(size, mtime_ns) of ``path``, or None if it is gone."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


def newer_file_of_another(path: str, known: tuple[int, int] | None, last_used_wall: float, fingerprint: str) -> bool:
    """``path`` was written by someone else since this process saw it (``known``) and holds a later
    use of the conversation than ``last_used_wall``: it must not be overwritten."""
    current = file_stat(path)
    if current is None or current == known:
        return False
    try:
        header = ws.read_header(path, fingerprint)
    except ws.CorruptSessionFile:
        return False  # nothing worth keeping
    return header.last_used_wall > last_used_wall


@dataclass
class WriteJob:
    key: str
    turn: int
    token_ids: list[int]
    block_hashes: list[bytes]
    last_used_wall: float
    known_stat: tuple[int, int] | None  # the file as this process last saw it
    packed: ws.PackedKV | None = None  # a spill's source
    blocks: list[Block] | None = None  # a write-behind's source (referenced for the job)


@dataclass
class Written:
    """A write done (or skipped: ``path`` None). The engine thread releases ``blocks`` and records the file."""

    key: str
    turn: int
    spill: bool
    blocks: list[Block] | None
    path: str | None = None
    stat: tuple[int, int] | None = None
    yielded: bool = False  # not written: another replica's file holds a later use


@dataclass
class RestoreJob:
    """Copy blocks ``start..`` of a conversation's warm KV into ``blocks`` where they match the request."""

    key: str
    request_id: str
    blocks: list[Block]  # reserved by the engine thread, referenced by the job
    start: int  # the request's first block to restore (the ones before are in the pool)
    hashes: list[bytes]  # the request's block hashes from ``start``
    token_ids: list[int]  # the request's prompt
    packed: ws.PackedKV | None = None  # the RAM copy, or None: read ``path``
    block_hashes: list[bytes] | None = None  # the RAM copy's block hashes
    path: str | None = None
    owner: str | None = None  # the session key the file must belong to


@dataclass
class Restored:
    """A restore done: the first ``count`` blocks hold the request's KV from ``start`` on.

    ``header`` is the file's (a disk restore); ``discarded`` when the file was
    rejected, ``missing`` when it was gone.
    """

    job: RestoreJob
    count: int = 0
    header: ws.SessionFileHeader | None = None
    stat: tuple[int, int] | None = None
    discarded: bool = False
    missing: bool = False


@dataclass
class _Delete:
    path: str
    stat: tuple[int, int] | None


# Not a job: what the storage thread acts on when the queue stayed empty for a listing period.
_IDLE = _Delete("", None)


class _Pacer:
    """Called between chunks of a job on the storage thread: idle time first, then paced; see ``BUSY_DUTY``."""

    def __init__(self, busy: Callable[[], bool]) -> None:
        self.busy = busy
        self._since = self._job_started = time.perf_counter()
        self._idle = False
        self._stuck_warned = False

    def start(self) -> None:
        """A job begins (on the storage thread): back to idle time."""
        self._since = self._job_started = time.perf_counter()
        if not self._idle:
            self._idle = compute_threads.run_in_idle_time(True)

    def __call__(self) -> None:
        now = time.perf_counter()
        if self._idle and now - self._job_started >= STARVED_AFTER_S:
            # Leaving the idle class needs CAP_SYS_NICE or an RLIMIT_NICE allowance (a container's
            # root often has neither): then this job and the next stay in idle time.
            if compute_threads.run_in_idle_time(False):
                self._idle = False
            elif not self._stuck_warned:
                self._stuck_warned = True
                log.warning(
                    "session storage runs in idle CPU time only (leaving SCHED_IDLE was refused): restores may wait under full load"
                )
        if not self._idle and self.busy():
            time.sleep((now - self._since) * (1 - BUSY_DUTY) / BUSY_DUTY)
        self._since = time.perf_counter()


Result = Written | Restored
_RESTORE, _OTHER = 0, 1  # queue priorities


class SessionStorage:
    """The I/O thread of the session tiers; see the module docstring."""

    def __init__(
        self,
        directory: str | None,
        fingerprint: str,
        warm_format: str,
        pack_blocks: Callable[[list[int], str], ws.PackedKV],
        write_blocks: Callable[..., None],
        block_size: int,
        busy: Callable[[], bool] = lambda: False,
    ) -> None:
        self.directory = directory
        self.fingerprint = fingerprint
        self.warm_format = warm_format
        self.pack_blocks = pack_blocks
        self.write_blocks = write_blocks
        self.block_size = block_size
        self._pace = _Pacer(busy)
        # Without a directory there are no files: only restores from RAM run here.
        if directory:
            os.makedirs(directory, exist_ok=True)
        self.listing: frozenset[str] = frozenset(os.listdir(directory)) if directory else frozenset()
        self._listed_at = time.monotonic()
        self._wanted: dict[str, int] = {}
        self._wanted_lock = threading.Lock()
        self._jobs: queue.PriorityQueue[tuple[int, int, WriteJob | RestoreJob | _Delete | None]] = queue.PriorityQueue()
        self._sequence = 0  # FIFO within a priority
        self._results: deque[Result] = deque()
        self._pending = 0
        self._done = threading.Condition()
        # The thread holds the storage weakly: an engine dropped without close() (tests, notebooks)
        # must not keep its KV pool alive through this thread's bound method.
        self._thread = threading.Thread(target=_serve, args=(weakref.ref(self), self._jobs), name="ember-session-storage", daemon=True)
        self._thread.start()

    def scan(self, warm_ttl_s: float) -> tuple[list[tuple[ws.SessionFileHeader, tuple[int, int]]], int]:
        """The session files left in the directory, oldest first, with their stat, and how many were
        discarded (start-up, before serving: the only synchronous I/O). Corrupt or foreign files are
        deleted; expired ones skipped."""
        assert self.directory, "no session directory"
        paths = [os.path.join(self.directory, f) for f in os.listdir(self.directory) if f.endswith(ws.SUFFIX)]
        found, discarded = [], 0
        for path in sorted(paths, key=os.path.getmtime):
            try:
                header = ws.read_header(path, self.fingerprint)
            except ws.CorruptSessionFile as exc:
                log.warning("discarding session file: %s", exc)
                os.unlink(path)
                discarded += 1
                continue
            stat = file_stat(path)
            if stat is not None and time.time() - header.last_used_wall < warm_ttl_s:
                found.append((header, stat))
        self._refresh_listing()
        return found, discarded

    def path_of(self, key: str) -> str:
        assert self.directory, "no session directory"
        return os.path.join(self.directory, ws.session_file_name(key))

    def has_file(self, key: str) -> bool:
        """Whether a file for ``key`` is in the directory: the listing, then one stat (see above)."""
        name = ws.session_file_name(key)
        return name in self.listing or (self.directory is not None and os.path.exists(os.path.join(self.directory, name)))

    # -- the engine thread's side ------------------------------------------------------

    def want(self, key: str, turn: int | None) -> None:
        """The turn of ``key`` that may be written from now on; None: nothing may be."""
        with self._wanted_lock:
            if turn is None:
                self._wanted.pop(key, None)
            else:
                self._wanted[key] = turn

    def write(self, job: WriteJob) -> None:
        self.want(job.key, job.turn)
        self._submit(job)

    def restore(self, job: RestoreJob) -> None:
        self._submit(job, _RESTORE)

    def delete(self, path: str, stat: tuple[int, int] | None) -> None:
        self._submit(_Delete(path, stat))

    def results(self) -> list[Result]:
        """Jobs finished since the last call (deque pops are thread-safe)."""
        out: list[Result] = []
        while self._results:
            out.append(self._results.popleft())
        return out

    def wait(self, timeout_s: float) -> None:
        """Return when a job finishes or ``timeout_s`` passes (for an engine with nothing else to do)."""
        with self._done:
            if not self._results:
                self._done.wait(timeout_s)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every job submitted so far is done; False on timeout (shutdown and tests only)."""
        with self._done:
            return self._done.wait_for(lambda: self._pending == 0, timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish the queued jobs, then stop the thread."""
        self._put(_OTHER, None)
        self._thread.join(timeout_s)

    def _submit(self, job: WriteJob | RestoreJob | _Delete, priority: int = _OTHER) -> None:
        with self._done:
            self._pending += 1
        self._put(priority, job)

    def _put(self, priority: int, job: WriteJob | RestoreJob | _Delete | None) -> None:
        with self._wanted_lock:
            self._sequence += 1
            sequence = self._sequence
        self._jobs.put((priority, sequence, job))

    # -- the storage thread -----------------------------------------------------------------

    def _run_job(self, job: WriteJob | RestoreJob | _Delete) -> None:
        try:
            self._do(job)
        except Exception:  # a full disk must not kill the thread
            log.exception("session storage job failed: %r", type(job).__name__)
            if isinstance(job, WriteJob):
                self._results.append(Written(job.key, job.turn, job.packed is not None, job.blocks))
            elif isinstance(job, RestoreJob):
                self._results.append(Restored(job))
        with self._done:
            self._pending -= 1
            self._done.notify_all()
        if time.monotonic() - self._listed_at >= LISTING_PERIOD_S:
            self._refresh_listing()

    def _do(self, job: WriteJob | RestoreJob | _Delete) -> None:
        self._pace.start()
        if isinstance(job, WriteJob):
            self._results.append(self._write(job))
        elif isinstance(job, RestoreJob):
            self._results.append(self._restore(job))
        else:
            if job.stat is not None and file_stat(job.path) == job.stat:
                try:
                    os.unlink(job.path)
                except OSError:
                    pass
            self._refresh_listing()

    def _write(self, job: WriteJob) -> Written:
        spill = job.packed is not None
        with self._wanted_lock:
            wanted = self._wanted.get(job.key) == job.turn
        if not wanted:
            return Written(job.key, job.turn, spill, job.blocks)
        path = self.path_of(job.key)
        if newer_file_of_another(path, job.known_stat, job.last_used_wall, self.fingerprint):
            return Written(job.key, job.turn, spill, job.blocks, yielded=True)
        packed = job.packed
        if packed is None:
            assert job.blocks is not None
            packed = self.pack_blocks([b.block_id for b in job.blocks], self.warm_format)
        self._pace()
        assert self.directory, "no session directory"  # path_of above holds it too: only a configured storage writes
        path, _ = ws.write_session_file(
            self.directory, job.key, self.fingerprint, job.token_ids, job.block_hashes, packed, job.last_used_wall, self._pace
        )
        stat = file_stat(path)
        self._refresh_listing()
        return Written(job.key, job.turn, spill, job.blocks, path if stat else None, stat)

    def _restore(self, job: RestoreJob) -> Restored:
        header, stat, packed, block_hashes, tokens = None, None, job.packed, job.block_hashes, None
        if packed is None:
            assert job.path is not None
            stat = file_stat(job.path)
            if stat is None:
                return Restored(job, missing=True)
            try:
                header, packed = ws.read_payload(job.path, self.fingerprint, job.owner, self._pace)
            except ws.CorruptSessionFile as exc:
                log.warning("discarding session file: %s", exc)
                try:
                    os.unlink(job.path)
                except OSError:
                    pass
                self._refresh_listing()
                return Restored(job, discarded=True)
            block_hashes, tokens = header.block_hashes, header.token_ids
        assert block_hashes is not None
        count = 0
        limit = min(len(job.blocks), len(job.hashes), len(block_hashes) - job.start, packed.num_blocks - job.start)
        while count < limit and block_hashes[job.start + count] == job.hashes[count]:
            count += 1
        bs = self.block_size
        if tokens is not None:  # the hashes chain over the whole prefix; still, restore only what repeats token for token
            span = slice(job.start * bs, (job.start + count) * bs)
            if tokens[span] != job.token_ids[span]:
                count = 0
        if count:
            ids = [b.block_id for b in job.blocks[:count]]
            for layer, kv in ws.unpack_layers(ws.slice_blocks(packed, job.start, job.start + count), torch.device("cpu")):
                self.write_blocks(ids, kv, layer)
                self._pace()
        return Restored(job, count, header, stat)

    def _refresh_listing(self) -> None:
        if not self.directory:
            return
        try:
            self.listing = frozenset(os.listdir(self.directory))
        except OSError:
            pass
        self._listed_at = time.monotonic()


def _serve(
    storage_ref: weakref.ref[SessionStorage], jobs: queue.PriorityQueue[tuple[int, int, WriteJob | RestoreJob | _Delete | None]]
) -> None:
    """The storage thread: run jobs in priority order, refresh the listing when idle; end on
    ``close`` or once the storage object is gone (it is strong-referenced only while working)."""
    compute_threads.confine_other_threads()  # torch single-threaded here: no second OpenMP pool
    while True:
        try:
            _, _, job = jobs.get(timeout=LISTING_PERIOD_S)
        except queue.Empty:
            job = _IDLE
        storage = storage_ref()
        if storage is None or job is None:
            return
        if job is _IDLE:
            storage._refresh_listing()
        else:
            storage._run_job(job)
        del storage
