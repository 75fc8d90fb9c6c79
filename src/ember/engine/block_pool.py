"""The KV block pool: fixed blocks, reference counts, and an LRU prefix cache.

A block is plain data. Its life:

* free: ``ref_count == 0`` and no hash. Allocated first.
* in use: ``ref_count > 0``. Each running request (and each hot session) that
  reads it holds one reference.
* cached: full blocks get a hash chained over every token before them, so a
  hash names a whole prefix. A cached block with ``ref_count == 0`` stays in the
  pool as reusable prefix and sits in an LRU queue; it is evicted (its hash
  dropped) only when no plain free block is left, least recently used first.

Invariants: a block is in exactly one of ``_free`` (ref 0, no hash),
``_evictable`` (ref 0, hashed) or in use (ref > 0). ``_cached`` maps a hash to
the one block holding it. Block 0 is reserved as padding and never handed out.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

NULL_BLOCK_ID = 0


def hash_block(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Chained block hash: blake2b over the parent's hash and this block's tokens.

    128 bits make collisions negligible and the value is stable across processes
    (session files on disk are keyed by it); a hit still compares the tokens.
    """
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] = field(default=())


class NoFreeBlocksError(RuntimeError):
    """Raised by ``allocate`` when neither free nor evictable blocks remain."""


class BlockPool:
    """Owns every block of the KV cache; see the module docstring for the invariants."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError("the KV pool needs at least 2 blocks (one is reserved)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.blocks[NULL_BLOCK_ID].ref_count = 1  # reserved forever
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self._evictable: OrderedDict[int, Block] = OrderedDict()  # LRU first
        self._cached: dict[bytes, Block] = {}
        self.num_evictions = 0

    # -- queries -----------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (plain free plus evictable cached)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by requests or sessions (the reserved block excluded)."""
        return self.num_blocks - 1 - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        return self.num_used_blocks / (self.num_blocks - 1)

    def lookup(self, block_hash: bytes, token_ids: Sequence[int]) -> Block | None:
        """The cached block for this hash whose tokens equal ``token_ids``, if any."""
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def evictable_order(self) -> list[int]:
        """Ids of evictable cached blocks, next victim first (for tests and metrics)."""
        return list(self._evictable)

    # -- mutations -----------------------------------------------------------

    def allocate(self, n: int) -> list[Block]:
        """Take ``n`` blocks with ``ref_count = 1``; evicts LRU cached blocks if needed."""
        if n > self.num_free_blocks:
            raise NoFreeBlocksError(f"need {n} blocks, {self.num_free_blocks} available")
        out = []
        for _ in range(n):
            if self._free:
                _, block = self._free.popitem(last=False)
            else:
                _, block = self._evictable.popitem(last=False)
                self._uncache(block)
                self.num_evictions += 1
            block.ref_count = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[Block]) -> None:
        """Add a reference to each block (a prefix hit, or a session pinning it)."""
        for block in blocks:
            if block.ref_count == 0:
                self._evictable.pop(block.block_id, None)
            block.ref_count += 1

    def release(self, blocks: Iterable[Block]) -> None:
        """Drop a reference from each block, in the given order.

        A block reaching zero becomes evictable (most recently used) if cached,
        free otherwise. Callers pass a request's blocks last-first so that a
        prefix's tail is evicted before its head, which more requests share.
        """
        for block in blocks:
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block.block_id} released more often than taken"
            if block.ref_count == 0:
                if block.block_hash is not None:
                    self._evictable[block.block_id] = block
                else:
                    self._free[block.block_id] = block

    def cache(self, block: Block, block_hash: bytes, token_ids: Sequence[int]) -> bool:
        """Register a full, computed block under its hash.

        Returns False (and leaves the block uncached) when another block already
        holds that hash: two requests computed the same prefix at once.
        """
        if block.block_hash is not None:
            return block.block_hash == block_hash
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._cached[block_hash] = block
        return True

    def drop_hash(self, block_hash: bytes) -> None:
        """Forget a cached prefix (e.g. a deleted session); its block stays as it is."""
        block = self._cached.get(block_hash)
        if block is not None:
            self._uncache(block)
            if block.ref_count == 0 and self._evictable.pop(block.block_id, None) is not None:
                self._free[block.block_id] = block

    def reset_prefix_cache(self) -> None:
        """Drop every unreferenced cached block (they become plain free blocks)."""
        while self._evictable:
            _, block = self._evictable.popitem(last=False)
            self._uncache(block)
            self._free[block.block_id] = block

    def _uncache(self, block: Block) -> None:
        if block.block_hash is not None and self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
        block.block_hash = None
        block.token_ids = ()
