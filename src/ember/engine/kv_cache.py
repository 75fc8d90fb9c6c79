"""The paged KV cache: device tensors plus the block bookkeeping of each request.

Memory layout: one tensor ``(layers, 2, num_blocks * block_size, KV, Hd)``;
token ``i`` of a request lives in slot ``block_ids[i // B] * B + i % B``.
The pool is sized from a byte budget, preallocated once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ember.config import EngineConfig, ModelConfig
from ember.engine import warm_storage as ws
from ember.engine.block_pool import Block, BlockPool, hash_block
from ember.engine.request import Request
from ember.kernels import cpu as cpu_kernels
from ember.model.kv_values import as_kv_values


def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return model.num_layers * 2 * block_size * model.num_kv_heads * model.head_dim * element


class KVCacheManager:
    """Allocates blocks to requests, finds cached prefixes, registers full blocks."""

    def __init__(self, model: ModelConfig, config: EngineConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.block_size = config.block_size
        self.enable_prefix_caching = config.enable_prefix_caching
        self.bytes_per_block = bytes_per_block(model, config.block_size, dtype)
        num_blocks = max(2, config.kv_cache_bytes // self.bytes_per_block)
        self.num_blocks = num_blocks
        self.kv = torch.zeros(
            model.num_layers, 2, num_blocks * config.block_size, model.num_kv_heads, model.head_dim, dtype=dtype, device=device
        )
        self.layer_caches = [(self.kv[i, 0], self.kv[i, 1]) for i in range(model.num_layers)]
        self.pool = BlockPool(num_blocks, config.block_size)
        self._blocks: dict[str, list[Block]] = {}
        self._num_registered: dict[str, int] = {}
        # Blocks published by ``publish_scheduled`` whose step has not ended: (request id,
        # its registered count before, the blocks). ``end_step`` keeps them, ``retract_step`` drops them.
        self._published: list[tuple[str, int, list[Block]]] = []
        # Counters (tokens): how much prompt work the prefix cache saved, by tier.
        self.prefix_queries_tokens = 0
        self.prefix_hit_tokens: dict[str, int] = {}
        # Called when an allocation does not fit: frees something (True) or cannot (False).
        # The engine wires it to the session tiers, which demote a hot conversation.
        self.on_pressure: Callable[[], bool] | None = None

    @property
    def total_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    @property
    def capacity_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    def blocks_of(self, request: Request) -> list[Block]:
        return self._blocks.get(request.request_id, [])

    # -- hashing -----------------------------------------------------------

    def full_block_hashes(self, request: Request) -> list[bytes]:
        """Chained hashes of every full block of the request's tokens (cached on it)."""
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.token_ids
        while (len(hashes) + 1) * bs <= len(tokens):
            start = len(hashes) * bs
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens[start : start + bs]))
        return hashes

    # -- prefix lookup -------------------------------------------------------

    def find_cached_prefix(self, request: Request) -> list[Block]:
        """Longest run of blocks in the pool matching the request's first tokens (changes nothing).

        At least one token is left uncached so the model produces the logits
        of the last position.
        """
        if not self.enable_prefix_caching:
            return []
        hashes = self.full_block_hashes(request)
        limit = (request.num_tokens - 1) // self.block_size
        hits: list[Block] = []
        bs = self.block_size
        for i, h in enumerate(hashes[:limit]):
            block = self.pool.lookup(h, request.token_ids[i * bs : (i + 1) * bs])
            if block is None:
                break
            hits.append(block)
        return hits

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of the KV of ``block_ids``: (layers, 2, n, block_size, KV, Hd)."""
        return self._block_view()[:, :, block_ids].clone()

    def pack_blocks(self, block_ids: list[int], fmt: str) -> ws.PackedKV:
        """The KV of ``block_ids`` packed for the warm tier (``warm_storage.pack``'s result).

        Safe from another thread while the blocks are referenced and full: nothing
        writes to them then (the session writer relies on it).
        """
        if fmt == "int8" and self.kv.dtype in (torch.float32, torch.float16) and self.kv.device.type == "cpu":
            kernels = cpu_kernels.load()
            if kernels is not None:  # gather and quantize in one pass, the same bits as ws.pack
                layers, two, _, heads, dim = self.kv.shape
                view = self.kv.view(layers, two, self.num_blocks, self.block_size * heads * dim)
                data, scales = kernels.pack_kv_int8(view, torch.tensor(block_ids, dtype=torch.long), dim)
                n = len(block_ids)
                return ws.PackedKV(
                    "int8",
                    data.view(layers, two, n, self.block_size, heads, dim),
                    scales.view(layers, two, n, self.block_size, heads, 1),
                    self.kv.dtype,
                )
        return ws.pack(self.read_blocks(block_ids), fmt)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor, layer: int | None = None) -> None:
        """Copy ``data`` (layers, 2, n, ...) into the blocks, or (2, n, ...) into one ``layer``'s."""
        view = self._block_view()
        index = torch.tensor(block_ids, dtype=torch.long, device=self.kv.device)
        if layer is None:
            view[:, :, index] = as_kv_values(data, self.kv.dtype)
        else:
            view[layer][:, index] = as_kv_values(data, self.kv.dtype)

    def _block_view(self) -> torch.Tensor:
        layers, two, _, heads, dim = self.kv.shape
        return self.kv.view(layers, two, self.num_blocks, self.block_size, heads, dim)

    # -- allocation ------------------------------------------------------------

    def can_allocate(self, request: Request, num_new_tokens: int, cached: Sequence[Block] = ()) -> bool:
        needed = self._blocks_needed(request, num_new_tokens, cached)
        reusable_idle = sum(1 for b in cached if b.ref_count == 0)
        return needed <= self.pool.num_free_blocks - reusable_idle

    def allocate(self, request: Request, num_new_tokens: int, cached: Sequence[Block] = ()) -> bool:
        """Give the request blocks for ``num_new_tokens`` more tokens.

        ``cached`` (only at admission) are prefix blocks found by
        ``find_cached_prefix``; they are referenced instead of recomputed and
        advance ``num_computed_tokens``. Returns False, changing nothing, when
        the pool cannot provide the blocks.
        """
        while not self.can_allocate(request, num_new_tokens, cached):
            # Under pressure, hot sessions give up their protection before anyone is preempted.
            if self.on_pressure is None or not self.on_pressure():
                return False
        blocks = self._blocks.setdefault(request.request_id, [])
        if cached:
            assert not blocks and request.num_computed_tokens == 0
            self.pool.touch(cached)
            blocks.extend(cached)
            request.num_computed_tokens = len(cached) * self.block_size
            self._num_registered[request.request_id] = len(cached)
        needed = self._blocks_needed(request, num_new_tokens, ())
        if needed > 0:
            blocks.extend(self.pool.allocate(needed))
        request.block_ids = [b.block_id for b in blocks]
        return True

    def _blocks_needed(self, request: Request, num_new_tokens: int, cached: Sequence[Block]) -> int:
        have = len(self._blocks.get(request.request_id, ())) + len(cached)
        computed = len(cached) * self.block_size if cached else request.num_computed_tokens
        total_tokens = computed + num_new_tokens
        return max(0, -(-total_tokens // self.block_size) - have)

    def record_prefix_query(self, request: Request) -> None:
        self.prefix_queries_tokens += request.num_tokens
        for tier, tokens in request.cached_tokens_by_tier.items():
            self.prefix_hit_tokens[tier] = self.prefix_hit_tokens.get(tier, 0) + tokens

    def register_computed_blocks(self, request: Request) -> None:
        """Publish the request's newly full and computed blocks as prefix cache."""
        self._register(request, request.num_computed_tokens)

    def publish_scheduled(self, request: Request, num_new_tokens: int) -> None:
        """Publish, before the step runs, the blocks this step's ``num_new_tokens`` will fill.

        In-step prefix sharing: a request admitted later in the same step finds
        them and computes only what follows (16 prompts with one system prompt,
        arriving together, compute its blocks once). Sound because of an
        invariant of the model's forward pass: in every layer, every scheduled
        token's K/V is written to the cache before any token of that layer
        attends, so a block is complete wherever this step reads it. The bits
        are those the sharer would have computed itself (the kernels give a
        token's K/V the same bits whatever the batch or chunk). Draft tokens are
        never published (their K/V holds only if accepted). Until
        ``end_step``, ``retract_step`` takes the blocks back (a failed step).
        """
        done = self._num_registered.get(request.request_id, 0)
        if self._register(request, request.num_computed_tokens + num_new_tokens):
            blocks = self._blocks[request.request_id][done : self._num_registered[request.request_id]]
            self._published.append((request.request_id, done, blocks))

    def end_step(self) -> None:
        """The step ran: what ``publish_scheduled`` published is computed."""
        self._published.clear()

    def retract_step(self) -> None:
        """The step failed: unpublish its blocks, whose KV may never have been written."""
        for request_id, done, blocks in reversed(self._published):
            for block in blocks:
                if block.block_hash is not None:
                    self.pool.drop_hash(block.block_hash)
            if request_id in self._num_registered:
                self._num_registered[request_id] = done
        self._published.clear()

    def _register(self, request: Request, num_tokens: int) -> bool:
        """Cache the request's full blocks among its first ``num_tokens``; True if any was new."""
        if not self.enable_prefix_caching:
            return False
        num_full = num_tokens // self.block_size
        done = self._num_registered.get(request.request_id, 0)
        if num_full <= done:
            return False
        hashes = self.full_block_hashes(request)
        blocks = self._blocks[request.request_id]
        bs = self.block_size
        for i in range(done, num_full):
            self.pool.cache(blocks[i], hashes[i], request.token_ids[i * bs : (i + 1) * bs])
        self._num_registered[request.request_id] = num_full
        return True

    def free(self, request: Request) -> None:
        """Release every block of the request (tail first; see ``BlockPool.release``)."""
        blocks = self._blocks.pop(request.request_id, None)
        self._num_registered.pop(request.request_id, None)
        if blocks:
            self.pool.release(reversed(blocks))
        request.block_ids = []

    def slot_of(self, request: Request, position: int) -> int:
        bs = self.block_size
        return request.block_ids[position // bs] * bs + position % bs
