"""Block pool: reference counts, chained hashes, LRU eviction order."""

from __future__ import annotations

import pytest

from ember.engine.block_pool import BlockPool, NoFreeBlocksError, hash_block


def test_hash_chains_over_prefix():
    a = hash_block(None, [1, 2, 3, 4])
    b = hash_block(a, [5, 6, 7, 8])
    assert hash_block(None, [1, 2, 3, 4]) == a
    assert hash_block(hash_block(None, [1, 2, 3, 9]), [5, 6, 7, 8]) != b  # same block, other prefix


def test_allocate_release_and_ref_counts():
    pool = BlockPool(num_blocks=5, block_size=4)
    assert pool.num_free_blocks == 4  # block 0 is reserved
    blocks = pool.allocate(3)
    assert [b.ref_count for b in blocks] == [1, 1, 1]
    pool.touch(blocks[:1])
    assert blocks[0].ref_count == 2
    pool.release(reversed(blocks))
    assert blocks[0].ref_count == 1 and pool.num_free_blocks == 3
    pool.release(blocks[:1])
    assert pool.num_free_blocks == 4 and pool.num_used_blocks == 0
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(5)


def test_lookup_compares_tokens_not_only_hashes():
    pool = BlockPool(num_blocks=3, block_size=2)
    (block,) = pool.allocate(1)
    h = hash_block(None, [7, 8])
    assert pool.cache(block, h, [7, 8])
    assert pool.lookup(h, [7, 8]) is block
    assert pool.lookup(h, [7, 9]) is None  # a forged/colliding hash with other tokens never hits


def test_eviction_is_lru_and_prefers_plain_free_blocks():
    pool = BlockPool(num_blocks=6, block_size=2)  # 5 usable
    blocks = pool.allocate(5)
    hashes = []
    for i, b in enumerate(blocks[:4]):
        h = hash_block(None, [i, i])
        hashes.append(h)
        pool.cache(b, h, [i, i])
    # Release in the order 2, 0, 3, 1 (cached) and then block 4 (never cached).
    for i in (2, 0, 3, 1, 4):
        pool.release([blocks[i]])
    assert pool.evictable_order() == [blocks[i].block_id for i in (2, 0, 3, 1)]
    # A hit refreshes recency: touch 2 then release it again -> it moves to the back.
    pool.touch([blocks[2]])
    pool.release([blocks[2]])
    assert pool.evictable_order() == [blocks[i].block_id for i in (0, 3, 1, 2)]
    # The uncached free block goes first; then cached ones strictly LRU.
    got = pool.allocate(1)
    assert got[0] is blocks[4] and pool.num_cached_blocks == 4
    victims = [pool.allocate(1)[0] for _ in range(3)]
    assert victims == [blocks[0], blocks[3], blocks[1]]
    assert pool.lookup(hashes[0], [0, 0]) is None and pool.lookup(hashes[2], [2, 2]) is blocks[2]
    assert pool.num_evictions == 3


def test_referenced_cached_blocks_are_never_evicted():
    pool = BlockPool(num_blocks=3, block_size=2)
    a, b = pool.allocate(2)
    pool.cache(a, hash_block(None, [1, 1]), [1, 1])
    pool.release([b])
    got = pool.allocate(1)
    assert got == [b]
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)  # a is referenced: not evictable
    assert pool.lookup(hash_block(None, [1, 1]), [1, 1]) is a
