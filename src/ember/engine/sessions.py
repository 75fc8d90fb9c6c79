"""Conversation sessions: carries out the tier policy's decisions on the pool, RAM and disk.

A session is one conversation (``X-Session-ID``, ``session_id`` or ``user``).
``tier_policy.py`` decides which tier a conversation is in and when it moves
(pure); ``session_storage.py`` does every file operation on its own thread;
``session_restore.py`` finds warm prefixes and has them copied back. This module holds each
session's data and, on the engine thread, applies the policy's ``Action``s and
the storage's results. The step loop never waits on a disk.

Threads: everything runs on the engine thread except ``ids.prompt_ids`` (the
event loop's; ``SessionIds`` has its own lock).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from ember.config import SessionConfig
from ember.engine import warm_storage as ws
from ember.engine.block_pool import Block
from ember.engine.heap_trim import HeapTrimmer
from ember.engine.kv_cache import KVCacheManager
from ember.engine.request import Request
from ember.engine.session_ids import SessionIds
from ember.engine.session_reports import SessionReports
from ember.engine.session_restore import PrefixRestorer, SessionData
from ember.engine.session_storage import Restored, SessionStorage, WriteJob, Written
from ember.engine.tier_policy import Action, Event, Tier, TierPolicy


class SessionManager(SessionReports):
    """The session table; see the module docstring (what it reports: ``SessionReports``)."""

    def __init__(
        self,
        config: SessionConfig,
        kv: KVCacheManager,
        fingerprint: str,
        decode: Callable[[list[int]], str],
        clock: Callable[[], float] = time.monotonic,
        busy: Callable[[], bool] = lambda: False,
    ) -> None:
        """``busy`` tells the storage thread that the engine is computing (it then paces itself)."""
        if config.warm_format not in ws.WARM_FORMATS:
            raise ValueError(f"warm_format must be one of {ws.WARM_FORMATS}, got {config.warm_format!r}")
        self.kv, self.clock = kv, clock
        directory = config.session_dir
        self.policy = TierPolicy(config, has_disk=bool(directory), writes_behind=bool(directory) and config.write_behind_s >= 0)
        self.storage = SessionStorage(directory, fingerprint, config.warm_format, kv.pack_blocks, kv.write_blocks, kv.block_size, busy)
        self.data: dict[str, SessionData] = {}
        self.ids = SessionIds(decode)
        self.events: Counter[str] = Counter()  # demote, restore_warm, spill, expire, evict, discard...
        self.restorer = PrefixRestorer(kv, self.policy, self.storage, self.data, self.ids, self.events, clock)
        self.trimmer = HeapTrimmer()  # dropped warm copies' pages go back to the system
        if directory:
            found, self.events["discard"] = self.storage.scan(config.warm_ttl_s)
            for header, stat in found:  # oldest first, so the table stays in LRU order
                self.policy.adopted(header.session_key, clock() - max(0.0, time.time() - header.last_used_wall), stat[0])
                data = self.data[header.session_key] = SessionData(header.token_ids, header.block_hashes, path=header.path, file_stat=stat)
                self.restorer.index(header.session_key, data)
                self.ids.publish(header.session_key, data.token_ids)

    @property
    def config(self) -> SessionConfig:
        return self.policy.config

    @config.setter
    def config(self, config: SessionConfig) -> None:
        """New TTLs and budgets (tests shrink them); the directory and format stay as they were."""
        self.policy.config = config

    def on_request_finished(self, request: Request, blocks: list[Block]) -> None:
        """The request's conversation becomes its session's hot state (refreshing the TTL)."""
        key = request.session_id
        if key is None or request.num_computed_tokens == 0:
            return  # an abort before any work leaves the session as it was
        full = min(request.num_computed_tokens // self.kv.block_size, len(blocks))
        old = self.data.pop(key, None)
        if old is not None:
            self._release(key, old)
        self.policy.turn_finished(key, self.clock())
        new = self.data[key] = SessionData(list(request.token_ids), self.kv.full_block_hashes(request)[:full], list(blocks[:full]))
        if old is not None:  # the older file stays: a valid prefix until the new turn is written
            new.path, new.file_stat = old.path, old.file_stat
        self.storage.want(key, None)  # a queued write of the old turn is stale now
        self.kv.pool.touch(new.hot_blocks)
        self.ids.publish(key, new.token_ids)
        self.events["turn"] += 1

    def tick(self) -> None:
        """Take back finished I/O, apply due TTLs and write-behinds, keep the budgets (engine thread)."""
        for result in self.storage.results():
            if isinstance(result, Restored):
                self.restorer.finish(result, self._expire)
            else:
                self._written(result)
        for action in self.policy.due(self.clock()):
            self._do(action)
        for action in self.policy.over_budget():  # after the demotions above: they fill RAM
            self._do(action)

    def relieve_pressure(self) -> bool:
        """The pool's pressure callback: demote the least recently used hot session; False if none is left."""
        action = self.policy.relieve_pressure()
        if action is None:
            return False
        self._do(action)
        for follow_up in self.policy.over_budget():
            self._do(follow_up)
        return True

    def _do(self, action: Action) -> None:
        key, data = action.key, self.data[action.key]
        record = self.policy.records[key]
        if action.kind == "demote":
            data.packed = self.kv.pack_blocks([b.block_id for b in data.hot_blocks], self.config.warm_format)
            self._release_hot(data)
            self.policy.move(key, Event.DEMOTED)
            self.policy.set_ram(key, data.packed.nbytes)
            self.restorer.index(key, data)
            self.events["demote"] += 1
            self.events["pressure_demote"] += action.reason == "pressure"
        elif action.kind in ("write_behind", "spill"):
            blocks = list(data.hot_blocks) if action.kind == "write_behind" else None
            self.kv.pool.touch(blocks or [])  # a write-behind's references: released with its result
            wall = time.time() - (self.clock() - record.last_used)  # files carry the wall clock (comparable across replicas)
            self.storage.write(
                WriteJob(
                    key,
                    record.turn,
                    list(data.token_ids),
                    list(data.block_hashes),
                    wall,
                    data.file_stat,
                    None if blocks else data.packed,
                    blocks,
                )
            )
            self.events["write_behind"] += blocks is not None
        elif action.kind == "drop_ram":
            self._to_disk(key, data)
            self.events["spill_reused"] += 1
        elif action.kind == "delete_copy":
            self._delete_file(key, data)
            self.events["copy_evict"] += 1
        else:
            assert action.kind == "expire", action
            self._expire(key, action.reason)

    def _written(self, result: Written) -> None:
        if result.blocks:
            self.kv.pool.release(reversed(result.blocks))
        self.policy.write_done(result.key)
        data, record = self.data.get(result.key), self.policy.records.get(result.key)
        if data is None or record is None:  # deleted meanwhile: what was written is nobody's
            if result.path is not None:
                self.storage.delete(result.path, result.stat)
            return
        if result.yielded:
            self.events["spill_yielded" if result.spill else "write_yielded"] += 1
            if result.spill:  # another replica's later turn is the state to keep
                data.path, data.file_stat = self.storage.path_of(result.key), None
                self.policy.set_file(result.key, record.turn, 0)
        elif result.path is not None and result.turn >= record.file_turn:  # turns only grow
            data.path, data.file_stat = result.path, result.stat
            self.policy.set_file(result.key, result.turn, result.stat[0] if result.stat else 0)
            self.events["spill"] += result.spill
        if result.spill and record.spilling:
            record.spilling = False
            if record.has_current_file and record.tier == Tier.WARM:
                self._to_disk(result.key, data)
            elif record.tier == Tier.WARM:  # the write failed: nothing on disk holds this state
                self._expire(result.key, "evict")

    def _to_disk(self, key: str, data: SessionData) -> None:
        self._drop_packed(data)
        self.policy.set_ram(key, 0)
        self.policy.move(key, Event.SPILLED)

    def _expire(self, key: str, reason: str) -> None:
        """-> cold: forget everything about the session."""
        data = self.data.pop(key)
        self._release(key, data)
        self._delete_file(key, data)
        self.policy.move(key, Event.DROPPED)
        self.ids.forget(key)
        self.events[reason] += 1

    def _release(self, key: str, data: SessionData) -> None:
        self._release_hot(data)
        self.restorer.unindex(key, data)
        self._drop_packed(data)

    def _drop_packed(self, data: SessionData) -> None:
        """Forget the warm copy in RAM (a restore in flight holds its own reference)."""
        packed, data.packed = data.packed, None
        if packed is not None:
            nbytes = packed.nbytes
            del packed
            self.trimmer.freed(nbytes)

    def _release_hot(self, data: SessionData) -> None:
        blocks, data.hot_blocks = data.hot_blocks, []
        self.kv.pool.release(reversed(blocks))
        # Blocks nobody else uses become free capacity at once (a prefix shared with hot conversations stays cached).
        for block in blocks:
            if block.ref_count == 0 and block.block_hash is not None:
                self.kv.pool.drop_hash(block.block_hash)

    def _delete_file(self, key: str, data: SessionData) -> None:
        self.storage.want(key, None)
        if data.path is not None:
            self.storage.delete(data.path, data.file_stat)
        data.path, data.file_stat = None, None
        self.policy.set_file(key, -1, 0)

    # -- whole-table operations --------------------------------------------------------------------

    def delete(self, key: str) -> bool:
        """Forget a session in every tier (its file is deleted by the storage thread)."""
        if key not in self.data:
            return False
        self._expire(key, "delete")
        return True

    def settle(self, timeout_s: float = 30.0) -> bool:
        """Wait for the storage thread's jobs and apply their results (shutdown and tests; never on the step loop)."""
        for _ in range(3):  # results can queue more I/O (a write done makes a spill free, a delete follows a late write)
            if not self.storage.flush(timeout_s):
                return False
            self.tick()
        return True

    def persist_all(self) -> int:
        """Write every hot and RAM-warm session to ``session_dir`` (at shutdown); returns how many are on disk."""
        if not self.config.session_dir:
            return 0
        for key in [k for k, r in self.policy.records.items() if r.tier == Tier.HOT]:
            self._do(Action("demote", key, "shutdown"))
        for action in self.policy.spill_all():
            self._do(action)
        self.settle()
        return sum(r.tier == Tier.DISK for r in self.policy.records.values())

    def close(self) -> None:
        """Stop the storage thread after the jobs already queued (call after ``persist_all``)."""
        self.storage.close()
