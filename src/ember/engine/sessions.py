"""Conversation sessions: hot, warm and cold tiers of KV state, behind the block hashes.

A session is one conversation (its id comes from ``X-Session-ID``, ``session_id``
or ``user``). After each turn the session remembers the conversation's tokens
and the hashes of its full KV blocks. Tier transitions:

    turn ends ──────────────▶ HOT   blocks stay in the pool, protected from LRU
                                    eviction by one reference the session holds
    hot_ttl passes, or the  ▶ WARM  KV packed into host RAM (``warm_format``);
    pool needs room (LRU)          its pool blocks are freed unless another
                                   hot conversation shares them
    RAM budget exceeded     ▶ WARM  (on disk) spilled to ``session_dir``
    warm_ttl passes, or the ▶ COLD  dropped; the next turn recomputes
    disk budget exceeded

With a ``session_dir``, a hot conversation idle for ``write_behind_s`` also gets
a *copy* on disk (session_writer.py) while it stays hot: a replica that dies
without warning leaves its recent conversations warm for the next replica (or
its own restart) instead of cold. A later spill of an unchanged session reuses
that file instead of writing it again.

A new turn reuses, in order: blocks still in the pool (whatever the session's
tier), then warm blocks, copied back into newly allocated pool blocks (a copy,
not a recompute). Lookup is by chained block hash plus token comparison, so a
request can only reuse state whose tokens it repeats exactly: nothing leaks
between conversations.

Every method runs on the engine thread except ``list_sessions`` and
``session_info``, which the HTTP thread may call; a lock guards the tables.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter, OrderedDict
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Callable

from ember.config import SessionConfig
from ember.engine import warm_storage as ws
from ember.engine.block_pool import Block
from ember.engine.session_writer import Finished, SessionWriter, WriteJob, file_stat, newer_file_of_another
from ember.engine.kv_cache import KVCacheManager
from ember.engine.request import Request

log = logging.getLogger("ember.sessions")

HOT, WARM, DISK = "hot", "warm", "disk"


@dataclass(eq=False)
class Session:
    """One conversation's state. ``tier`` is hot, warm (RAM) or disk (warm on disk).

    ``path`` is set whenever a file this process wrote or adopted holds some
    turn of the conversation (``file_turn``): always for the disk tier, and for
    hot and RAM-warm sessions once written behind. ``file_stat`` is the file as
    this process last saw it; a file that no longer matches was rewritten by
    another replica sharing the directory, and is not ours to reuse or delete.
    """

    key: str
    token_ids: list[int]
    block_hashes: list[bytes]
    tier: str
    last_used: float
    turn: int = 0  # bumped on every finished turn, process-wide
    hot_blocks: list[Block] = field(default_factory=list)
    packed: ws.PackedKV | None = None
    path: str | None = None
    disk_bytes: int = 0
    file_turn: int = -1
    file_stat: tuple[int, int] | None = None
    write_submitted: bool = False  # a write-behind of this turn is queued or done
    text: str | None = None  # decoded token_ids, for matching the next turn's prompt

    def file_is_current(self) -> bool:
        """The file on disk is ours and holds exactly this state."""
        return self.path is not None and self.file_turn == self.turn and file_stat(self.path) == self.file_stat

    @property
    def ram_bytes(self) -> int:
        return self.packed.nbytes if self.packed is not None else 0


class SessionManager:
    """Owns the session table and every tier transition; see the module docstring."""

    def __init__(
        self,
        config: SessionConfig,
        kv: KVCacheManager,
        fingerprint: str,
        decode: Callable[[list[int]], str],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if config.warm_format not in ws.WARM_FORMATS:
            raise ValueError(f"warm_format must be one of {ws.WARM_FORMATS}, got {config.warm_format!r}")
        self.config = config
        self.kv = kv
        self.fingerprint = fingerprint
        self.decode = decode
        self.clock = clock
        self.sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        # Warm (RAM or disk) sessions by block hash: hash -> (session key, block index).
        self._index: dict[bytes, tuple[str, int]] = {}
        self.ram_bytes = 0
        self.disk_bytes = 0
        self.events: Counter[str] = Counter()  # demote, restore, spill, expire, evict, discard...
        self._lock = threading.RLock()
        self._next_check = 0.0
        self._turns = 0
        self.writer: SessionWriter | None = None
        self._pinned: Counter[str] = Counter()  # keys with write-behind jobs not yet taken back
        if config.session_dir:
            self._scan_directory()
            if config.write_behind_s >= 0:
                self.writer = SessionWriter(config.session_dir, fingerprint, config.warm_format, kv.pack_blocks)

    # -- turn boundaries --------------------------------------------------------

    def on_request_finished(self, request: Request, blocks: list[Block]) -> None:
        """The request's conversation becomes its session's hot state (refreshing the TTL)."""
        key = request.session_id
        if key is None:
            return
        full = min(request.num_computed_tokens // self.kv.block_size, len(blocks))
        hashes = self.kv.full_block_hashes(request)[:full]
        with self._lock:
            self._turns += 1
            new = Session(
                key=key, token_ids=list(request.token_ids), block_hashes=hashes, tier=HOT,
                last_used=self.clock(), turn=self._turns, hot_blocks=list(blocks[:full]),
            )
            old = self.sessions.pop(key, None)
            if old is not None:
                # The previous turn's file stays: it is a valid prefix until the new one is written.
                self._drop_state(old, keep_file=True)
                new.path, new.disk_bytes, new.file_turn, new.file_stat = old.path, old.disk_bytes, old.file_turn, old.file_stat
            if self.writer is not None:
                self.writer.want(key, None)  # a queued write of the old turn is stale now
            self.kv.pool.touch(blocks[:full])
            self.sessions[key] = new
            due = self.config.hot_ttl_s if self.writer is None else min(self.config.hot_ttl_s, self.config.write_behind_s)
            self._next_check = min(self._next_check, new.last_used + due)
            self.events["turn"] += 1

    def prompt_ids(self, key: str, rendered: str, encode: Callable[[str], list[int]]) -> list[int] | None:
        """Token ids for a new turn that reuse the tokens the engine generated.

        Re-tokenizing the previous answer can give other ids than the ones the
        model produced (BPE is not unique), which would cut prefix reuse at the
        first difference. When the new prompt's text extends the session's text
        exactly, the session's own ids are kept and only the rest is encoded.
        """
        with self._lock:
            session = self.sessions.get(key)
            if session is None:
                return None
            if session.text is None:
                session.text = self.decode(session.token_ids)
            text, ids = session.text, session.token_ids
        if not text or not rendered.startswith(text):
            return None
        return ids + encode(rendered[len(text):])

    # -- the clock ------------------------------------------------------------------

    def tick(self) -> None:
        """Apply TTLs: hot -> warm after ``hot_ttl_s``, warm -> cold after ``warm_ttl_s``;
        write idle hot sessions behind after ``write_behind_s``."""
        if self.writer is not None:
            with self._lock:
                self._account_writes()
        now = self.clock()
        if now < self._next_check:
            return
        with self._lock:
            next_event = float("inf")
            for session in list(self.sessions.values()):
                if session.tier == HOT:
                    due = session.last_used + self.config.hot_ttl_s
                    if now >= due:
                        self._demote(session)
                        due = session.last_used + self.config.warm_ttl_s
                    elif self.writer is not None and not session.write_submitted and session.file_turn != session.turn:
                        write_at = session.last_used + self.config.write_behind_s
                        if now < write_at:
                            due = min(due, write_at)
                        elif self.disk_bytes < self.config.warm_disk_bytes:  # else it would be evicted at once
                            self._write_behind(session)
                else:
                    due = session.last_used + self.config.warm_ttl_s
                    if now >= due:
                        self._expire(session, "expire")
                        continue
                next_event = min(next_event, due)
            self._next_check = next_event

    def relieve_pressure(self) -> bool:
        """Demote the least recently used hot session; False if there is none.

        A session whose write-behind is in flight is passed over: the writer's
        references keep its blocks in the pool, so demoting it frees nothing.
        Only if every hot session is in flight does this wait for the writer.
        """
        with self._lock:
            for attempt in range(2):
                if self.writer is not None:
                    if attempt:
                        self.writer.flush()
                    self._account_writes()
                for session in self.sessions.values():
                    if session.tier == HOT and session.key not in self._pinned:
                        self._demote(session)
                        self.events["pressure_demote"] += 1
                        return True
                if not self._pinned:
                    break
        return False

    def close(self) -> None:
        """Stop the write-behind thread after the jobs already queued (call after ``persist_all``)."""
        if self.writer is not None:
            self.writer.close()

    def persist_all(self) -> int:
        """Write every hot and RAM-warm session to ``session_dir`` (at shutdown); returns how many."""
        if not self.config.session_dir:
            return 0
        written = 0
        with self._lock:
            if self.writer is not None:
                self.writer.flush()  # the copies written behind make most of the spills below free
                self._account_writes()
            for session in list(self.sessions.values()):
                if session.tier == HOT:
                    self._demote(session)
                if session.tier == WARM and session.packed is not None:
                    self._spill(session)
                    written += session.tier == DISK
        return written

    # -- restoring a prefix ------------------------------------------------------------

    def restore_prefix(self, request: Request, start: int, hashes: list[bytes]) -> tuple[list[Block], str]:
        """Copy warm blocks ``start..`` matching ``hashes`` back into the pool.

        Returns the restored blocks (cached, unreferenced: the caller takes them
        like any prefix hit) and the tier they came from.
        """
        if start >= len(hashes):
            return [], ""
        with self._lock:
            session = self._candidate(request, start, hashes)
            if session is None:
                return [], ""
            tier = session.tier
            packed = session.packed
            if packed is None:
                packed = self._load(session)  # may refresh the session from its file
                if packed is None:
                    return [], ""
            count = 0
            bs = self.kv.block_size
            while (
                start + count < len(hashes)
                and start + count < len(session.block_hashes)
                and session.block_hashes[start + count] == hashes[start + count]
            ):
                count += 1
            # Hashes chain over the whole prefix; still, reuse only what repeats token for token.
            end_token = (start + count) * bs
            if request.token_ids[start * bs : end_token] != session.token_ids[start * bs : end_token]:
                return [], ""
            count = min(count, self.kv.pool.num_free_blocks, packed.num_blocks - start)
            if count <= 0:
                return [], ""
            blocks = self.kv.pool.allocate(count)
            self.kv.write_blocks([b.block_id for b in blocks], ws.unpack(ws.slice_blocks(packed, start, start + count), self.kv.kv.device))
            for i, block in enumerate(blocks):
                index = start + i
                self.kv.pool.cache(block, hashes[index], request.token_ids[index * bs : (index + 1) * bs])
            self.kv.pool.release(reversed(blocks))  # cached and idle: the admission touches them
            self.events[f"restore_{tier}"] += 1
            return blocks, tier

    def _candidate(self, request: Request, start: int, hashes: list[bytes]) -> Session | None:
        hit = self._index.get(hashes[start])
        if hit is not None and hit[1] == start:
            session = self.sessions.get(hit[0])
            if session is not None and session.tier != HOT:
                return session
        key = request.session_id
        if key is None:
            return None
        session = self.sessions.get(key)
        if session is not None:
            return session if session.tier != HOT else None
        return self._adopt_file(key)  # written by another replica sharing session_dir

    # -- transitions ----------------------------------------------------------------------

    def _demote(self, session: Session) -> None:
        """Hot -> warm: pack the blocks, release the pool references."""
        blocks = session.hot_blocks
        session.hot_blocks = []
        if blocks:
            session.packed = self.kv.pack_blocks([b.block_id for b in blocks], self.config.warm_format)
            self.kv.pool.release(reversed(blocks))
            # The state moves out of the pool: blocks no one else uses become free
            # capacity at once (a prefix shared with hot conversations stays cached).
            for block in blocks:
                if block.ref_count == 0 and block.block_hash is not None:
                    self.kv.pool.drop_hash(block.block_hash)
        session.tier = WARM
        self.ram_bytes += session.ram_bytes
        self._index_session(session)
        self.events["demote"] += 1
        self._enforce_ram_budget(keep=session)

    def _enforce_ram_budget(self, keep: Session | None = None) -> None:
        for session in list(self.sessions.values()):
            if self.ram_bytes <= self.config.warm_memory_bytes:
                return
            if session.tier != WARM or session.packed is None:
                continue
            self._spill(session)
        if keep is not None and self.ram_bytes > self.config.warm_memory_bytes and keep.tier == WARM:
            self._spill(keep)  # bigger than the whole budget on its own

    def _spill(self, session: Session) -> None:
        """Warm RAM -> warm disk (or cold without a session_dir)."""
        assert session.packed is not None
        if not self.config.session_dir:
            self._expire(session, "evict")
            return
        try:
            with self._file_lock():
                self._collect_writes(session)  # a write-behind that just finished may make this one free
                path = os.path.join(self.config.session_dir, ws.session_file_name(session.key))
                wall = self._last_used_wall(session)
                if session.file_is_current():
                    self.events["spill_reused"] += 1
                elif newer_file_of_another(path, session.file_stat, wall, self.fingerprint):
                    # Another replica served a later turn: its file is the state to keep (and
                    # to restore from: _load takes the file's tokens over this session's).
                    self._set_file(session, path, session.turn, file_stat(path))
                    self.events["spill_yielded"] += 1
                else:
                    path, _ = ws.write_session_file(
                        self.config.session_dir, session.key, self.fingerprint, session.token_ids,
                        session.block_hashes, session.packed, wall,
                    )
                    self._set_file(session, path, session.turn, file_stat(path))
                    self.events["spill"] += 1
        except OSError as exc:
            log.warning("cannot spill session to %s: %s", self.config.session_dir, exc)
            self._expire(session, "evict")
            return
        self.ram_bytes -= session.ram_bytes
        session.packed = None
        session.tier = DISK
        self._enforce_disk_budget()

    def _write_behind(self, session: Session) -> None:
        """Queue a hot session's blocks for the writer thread, which copies them (holding a reference)."""
        assert self.writer is not None
        session.write_submitted = True
        if not session.hot_blocks:
            return
        blocks = list(session.hot_blocks)
        self.kv.pool.touch(blocks)  # released by _finish_write
        self._pinned[session.key] += 1
        self.writer.submit(WriteJob(
            session.key, session.turn, blocks, list(session.token_ids), list(session.block_hashes),
            self._last_used_wall(session), session.file_stat,
        ))
        self.events["write_behind"] += 1

    def _last_used_wall(self, session: Session) -> float:
        """When the session was last used, by the wall clock files carry (comparable across replicas)."""
        return time.time() - (self.clock() - session.last_used)

    def _account_writes(self) -> None:
        """Take back the writer's finished jobs, then keep the disk budget (engine thread, under the lock)."""
        self._take_back_writes()
        self._enforce_disk_budget()

    def _take_back_writes(self, dropping: Session | None = None) -> None:
        """Release the blocks of the writer's finished jobs and attach their files.

        ``dropping`` is a session already out of the table whose results are its own.
        """
        assert self.writer is not None
        for finished in self.writer.results():
            own = dropping is not None and finished.key == dropping.key
            self._finish_write(finished, dropping if own else self.sessions.get(finished.key))

    def _finish_write(self, finished: Finished, session: Session | None) -> None:
        self.kv.pool.release(reversed(finished.blocks))
        if finished.yielded:
            self.events["write_yielded"] += 1
        self._pinned[finished.key] -= 1
        if self._pinned[finished.key] <= 0:
            del self._pinned[finished.key]
        # Turns only grow: a file of an older turn than the one recorded is not the file on disk.
        if finished.path is not None and session is not None and finished.turn >= session.file_turn:
            self._set_file(session, finished.path, finished.turn, finished.stat)

    def _collect_writes(self, session: Session) -> None:
        """Stop writes of ``session``'s key and take back finished ones (hold the file lock:
        then no write of the key is in progress and none will start)."""
        if self.writer is None:
            return
        self.writer.want(session.key, None)
        self._take_back_writes(dropping=session)  # ``session`` may already be out of the table

    def _set_file(self, session: Session, path: str, turn: int, stat: tuple[int, int] | None) -> None:
        self.disk_bytes -= session.disk_bytes
        session.path, session.file_turn, session.file_stat = path, turn, stat
        session.disk_bytes = stat[0] if stat is not None else 0
        self.disk_bytes += session.disk_bytes

    def _file_lock(self) -> AbstractContextManager[object]:
        return self.writer.file_lock if self.writer is not None else nullcontext()

    def _enforce_disk_budget(self) -> None:
        if self.disk_bytes <= self.config.warm_disk_bytes:
            return  # the usual case, and this runs on every engine step with a writer: no table walk
        # First the copies of hot and RAM-warm sessions: they are only insurance against
        # a crash; their session keeps ``write_submitted``, so the turn is not written again.
        for session in list(self.sessions.values()):
            if self.disk_bytes <= self.config.warm_disk_bytes:
                return
            if session.tier != DISK and session.path is not None:
                self._delete_file(session)
                self.events["copy_evict"] += 1
        for session in list(self.sessions.values()):
            if self.disk_bytes <= self.config.warm_disk_bytes:
                return
            if session.tier == DISK:
                self._expire(session, "evict")

    def _expire(self, session: Session, reason: str) -> None:
        """-> cold: forget everything about the session."""
        self.sessions.pop(session.key, None)
        self._drop_state(session)
        self.events[reason] += 1

    def _drop_state(self, session: Session, keep_file: bool = False) -> None:
        if session.hot_blocks:
            self.kv.pool.release(reversed(session.hot_blocks))
            session.hot_blocks = []
        self.ram_bytes -= session.ram_bytes
        session.packed = None
        if not keep_file:  # else the caller hands the file (and its bytes) to the next turn's session
            self._delete_file(session)
        self._unindex_session(session)

    def _delete_file(self, session: Session) -> None:
        """Forget the session's file, and delete it unless another replica has rewritten it since."""
        with self._file_lock():
            self._collect_writes(session)
            if session.path is not None:
                if session.file_stat is not None and file_stat(session.path) == session.file_stat:
                    try:
                        os.unlink(session.path)
                    except OSError:
                        pass
                self.disk_bytes -= session.disk_bytes
        session.path, session.disk_bytes, session.file_turn, session.file_stat = None, 0, -1, None

    def _index_session(self, session: Session) -> None:
        for i, h in enumerate(session.block_hashes):
            self._index[h] = (session.key, i)

    def _unindex_session(self, session: Session) -> None:
        """Drop the session's entries (not those another session has claimed since)."""
        for i, h in enumerate(session.block_hashes):
            if self._index.get(h) == (session.key, i):
                del self._index[h]

    # -- disk ------------------------------------------------------------------------------

    def _load(self, session: Session) -> ws.PackedKV | None:
        assert session.path is not None
        try:
            header, packed = ws.read_payload(session.path, self.fingerprint, session.key)
        except ws.CorruptSessionFile as exc:
            log.warning("discarding session file: %s", exc)
            self.events["discard"] += 1
            self._expire(session, "discard_expire")
            return None
        if header.block_hashes != session.block_hashes or header.token_ids != session.token_ids:
            # Another replica sharing session_dir rewrote the file: the file is the truth.
            self._unindex_session(session)
            session.block_hashes, session.token_ids, session.text = header.block_hashes, header.token_ids, None
            self._index_session(session)
            self._set_file(session, session.path, session.file_turn, file_stat(session.path))
        return packed

    def _adopt_file(self, key: str) -> Session | None:
        if not self.config.session_dir:
            return None
        path = os.path.join(self.config.session_dir, ws.session_file_name(key))
        if not os.path.isfile(path):
            return None
        return self._register_file(path)

    def _register_file(self, path: str) -> Session | None:
        try:
            header = ws.read_header(path, self.fingerprint)
        except ws.CorruptSessionFile as exc:
            log.warning("discarding session file: %s", exc)
            self.events["discard"] += 1
            try:
                os.unlink(path)
            except OSError:
                pass
            return None
        age = max(0.0, time.time() - header.last_used_wall)
        if age >= self.config.warm_ttl_s:
            return None
        stat = file_stat(path)
        if stat is None:
            return None
        self._turns += 1
        session = Session(
            key=header.session_key, token_ids=header.token_ids, block_hashes=header.block_hashes,
            tier=DISK, last_used=self.clock() - age, turn=self._turns, path=path, disk_bytes=stat[0],
            file_turn=self._turns, file_stat=stat,
        )
        self.sessions[session.key] = session
        self.disk_bytes += stat[0]
        self._index_session(session)
        return session

    def _scan_directory(self) -> None:
        directory = self.config.session_dir
        assert directory is not None
        os.makedirs(directory, exist_ok=True)
        files = sorted(
            (os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(ws.SUFFIX)), key=os.path.getmtime
        )
        for path in files:  # oldest first, so the table stays in LRU order
            self._register_file(path)

    # -- inspection (any thread) ---------------------------------------------------------------

    def session_info(self, session: Session) -> dict[str, object]:
        ttl = self.config.hot_ttl_s if session.tier == HOT else self.config.warm_ttl_s
        now = self.clock()
        return {
            "id": session.key,
            "tier": "warm" if session.tier == DISK else session.tier,
            "location": {HOT: "pool", WARM: "ram", DISK: "disk"}[session.tier],
            "tokens": len(session.token_ids),
            "cached_tokens": len(session.block_hashes) * self.kv.block_size,
            "bytes": len(session.hot_blocks) * self.kv.bytes_per_block if session.tier == HOT else session.ram_bytes or session.disk_bytes,
            "last_used_s_ago": round(now - session.last_used, 3),
            # A copy of this very state is on disk (always for the disk tier; once written behind for the others).
            "on_disk": session.file_is_current(),
            "expires_in_s": round(session.last_used + ttl - now, 3),
        }

    def list_sessions(self, prefix: str = "") -> list[dict[str, object]]:
        with self._lock:
            return [self.session_info(s) for s in reversed(self.sessions.values()) if s.key.startswith(prefix)]

    def get(self, key: str) -> dict[str, object] | None:
        with self._lock:
            session = self.sessions.get(key)
            return None if session is None else self.session_info(session)

    def delete(self, key: str) -> bool:
        """Forget a session in every tier (engine thread: it may release pool blocks)."""
        with self._lock:
            session = self.sessions.get(key)
            if session is None:
                return False
            self._expire(session, "delete")
            return True

    def tier_counts(self) -> dict[str, int]:
        with self._lock:
            counts = Counter(s.tier for s in self.sessions.values())
        return {HOT: counts[HOT], WARM: counts[WARM], DISK: counts[DISK]}

    def tier_bytes(self) -> dict[str, int]:
        with self._lock:
            hot = sum(len(s.hot_blocks) for s in self.sessions.values()) * self.kv.bytes_per_block
        return {HOT: hot, WARM: self.ram_bytes, DISK: self.disk_bytes}
