"""Finding the warm KV that continues a request's prompt and getting it back into the pool.

A new turn reuses, in order: blocks still in the pool (whatever the
conversation's tier: the pool's own prefix lookup at admission), then warm
blocks. Those are copied back off the step loop: ``begin_restore`` (when the
request is added) reserves pool blocks and hands the copy to the storage
thread, from the RAM copy or from the file; the request waits outside the
scheduler meanwhile, and other sequences keep decoding. ``finish`` (engine
thread) caches the filled blocks under the request's hashes and pins them on
the request until its admission finds them (``take_pins``).

Lookup is by chained block hash (an index over every warm conversation's
blocks, so a shared system prompt restores for anyone) and then token by
token, so a request only ever reuses state whose tokens it repeats exactly:
nothing leaks between conversations.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ember.engine import warm_storage as ws
from ember.engine.block_pool import Block
from ember.engine.kv_cache import KVCacheManager
from ember.engine.request import Request
from ember.engine.session_ids import SessionIds
from ember.engine.session_storage import Restored, RestoreJob, SessionStorage
from ember.engine.tier_policy import Tier, TierPolicy


@dataclass(eq=False)
class SessionData:
    """One conversation's state; its tier and budgets are in the policy's ``TierRecord``."""

    token_ids: list[int]
    block_hashes: list[bytes]
    hot_blocks: list[Block] = field(default_factory=list)
    packed: ws.PackedKV | None = None
    path: str | None = None  # our file (a copy, or the disk tier)
    file_stat: tuple[int, int] | None = None  # the file as we last saw it: tells ours from a rewrite


@dataclass
class Pins:
    """Restored blocks held for a request until its admission: from block ``start`` on, from ``tier``."""

    blocks: list[Block]
    start: int
    tier: str


class PrefixRestorer:
    """The warm-block index and the restores in flight; see the module docstring."""

    def __init__(
        self,
        kv: KVCacheManager,
        policy: TierPolicy,
        storage: SessionStorage,
        data: dict[str, SessionData],
        ids: SessionIds,
        events: Counter[str],
        clock: Callable[[], float],
    ) -> None:
        self.kv, self.policy, self.storage, self.data, self.ids, self.events, self.clock = kv, policy, storage, data, ids, events, clock
        self._index: dict[bytes, tuple[str, int]] = {}  # warm block hash -> (session key, block index)
        self._pins: dict[str, Pins] = {}  # request id -> restored blocks waiting for its admission
        self._ready: list[str] = []

    def index(self, key: str, data: SessionData) -> None:
        for i, h in enumerate(data.block_hashes):
            self._index[h] = (key, i)

    def unindex(self, key: str, data: SessionData) -> None:
        """Drop the session's entries (not those another session has claimed since)."""
        for i, h in enumerate(data.block_hashes):
            if self._index.get(h) == (key, i):
                del self._index[h]

    def begin_restore(self, request: Request) -> bool:
        """Start copying the warm KV that continues the request's pooled prefix; True: the request must wait."""
        if not self.kv.enable_prefix_caching:
            return False
        # At least one token stays uncached so the model produces the last position's logits.
        hashes = self.kv.full_block_hashes(request)[: (request.num_tokens - 1) // self.kv.block_size]
        start = len(self.kv.find_cached_prefix(request))
        if start >= len(hashes):
            return False
        job, wanted = None, len(hashes) - start  # a file may hold more than we know: reserve for the whole prompt
        sid = request.session_id
        # A conversation this process never saw may have a file another replica wrote (one stat).
        foreign_file = sid is not None and sid not in self.data and self.storage.has_file(sid)
        key = None if foreign_file else self._candidate(request, start, hashes)
        common: dict[str, Any] = {
            "request_id": request.request_id,
            "blocks": [],
            "start": start,
            "hashes": hashes[start:],
            "token_ids": list(request.token_ids),
        }
        if foreign_file:
            assert sid is not None
            job = RestoreJob(sid, path=self.storage.path_of(sid), owner=sid, **common)
        elif key is not None and self.policy.records[key].tier == Tier.WARM:
            wanted = self._matching_blocks(request, self.data[key], start, hashes)
            job = RestoreJob(key, packed=self.data[key].packed, block_hashes=self.data[key].block_hashes, **common)
        elif key is not None and self.data[key].path is not None:  # on disk
            job = RestoreJob(key, path=self.data[key].path, owner=key, **common)
        if job is None or wanted <= 0 or (job.packed is None and job.path is None):
            return False
        job.blocks = self.kv.pool.allocate(min(wanted, self.kv.pool.num_free_blocks))
        if not job.blocks:
            return False
        self.policy.touch(job.key, self.clock())
        self.storage.restore(job)
        return True

    def _candidate(self, request: Request, start: int, hashes: list[bytes]) -> str | None:
        """The warm conversation whose blocks continue the request at block ``start``.

        The request's own session comes first: conversations that open alike (one system
        prompt) share their first blocks, so the block index alone may name another
        conversation whose copy diverges a block later."""
        sid = request.session_id
        if sid is not None:
            record = self.policy.records.get(sid)
            if record is not None and record.tier in (Tier.WARM, Tier.DISK):
                return sid
        hit = self._index.get(hashes[start])
        if hit is None or hit[1] != start:
            return None
        record = self.policy.records.get(hit[0])
        return hit[0] if record is not None and record.tier in (Tier.WARM, Tier.DISK) else None

    def _matching_blocks(self, request: Request, data: SessionData, start: int, hashes: list[bytes]) -> int:
        """How many of the RAM copy's blocks from ``start`` repeat the request (hash, then token by token)."""
        if data.packed is None:
            return 0
        count, bs = 0, self.kv.block_size
        limit = min(len(hashes), len(data.block_hashes), data.packed.num_blocks)
        while start + count < limit and data.block_hashes[start + count] == hashes[start + count]:
            count += 1
        end = (start + count) * bs
        return count if request.token_ids[start * bs : end] == data.token_ids[start * bs : end] else 0

    # -- results (engine thread) -----------------------------------------------------------------

    def finish(self, result: Restored, expire: Callable[[str, str], None]) -> None:
        """Cache the filled blocks under the request's hashes and pin them for its admission."""
        job = result.job
        bs = self.kv.block_size
        for i, block in enumerate(job.blocks[: result.count]):
            at = job.start + i
            self.kv.pool.cache(block, job.hashes[i], job.token_ids[at * bs : (at + 1) * bs])
        self.kv.pool.release(reversed(job.blocks[result.count :]))  # unfilled: free again
        tier = "warm" if job.packed is not None else "disk"
        if result.count:
            self._pins[job.request_id] = Pins(job.blocks[: result.count], job.start, tier)
            self.events[f"restore_{tier}"] += 1
        self._ready.append(job.request_id)
        self.events["discard"] += result.discarded
        record = self.policy.records.get(job.key)
        if (result.discarded or result.missing) and record is not None and record.tier == Tier.DISK:
            expire(job.key, "discard_expire" if result.discarded else "expire")
        elif result.header is not None and record is not None and record.tier == Tier.DISK:
            self._adopt_file(job.key, result)

    def _adopt_file(self, key: str, result: Restored) -> None:
        """The file another replica may have rewritten is the truth for a disk-tier session."""
        assert result.header is not None
        data = self.data[key]
        if result.header.token_ids != data.token_ids:
            self.unindex(key, data)
            data.token_ids, data.block_hashes = result.header.token_ids, result.header.block_hashes
            self.index(key, data)
            self.ids.publish(key, data.token_ids)
        data.path, data.file_stat = result.job.path, result.stat

    def take_ready(self) -> list[str]:
        """Ids of the requests whose restores are done: they may be scheduled now."""
        ready, self._ready = self._ready, []
        return ready

    def take_pins(self, request_id: str) -> Pins | None:
        """The restored blocks held for a request; the caller releases them (at admission, after its
        prefix lookup has found them, or when the request ends without one)."""
        return self._pins.pop(request_id, None)
