"""Continuous batching under a per-step token budget.

Each step the scheduler fills a budget of ``max_num_batched_tokens``:

1. running requests that need one token (decodes) go first, so streams keep
   their pace whatever arrives; one that speculates brings its draft's tokens
   (engine/speculation.py) when they fit;
2. running requests still in prefill get the next chunk of their prompt;
3. waiting requests are admitted in (priority, arrival) order, each reusing its
   longest cached prefix and computing at most the budget that is left.

Every scheduled request publishes the blocks this step will fill at once
(``KVCacheManager.publish_scheduled``), so requests admitted together share a
prefix within the step: the first computes it, the others only what follows.

A long prompt therefore delays running streams by at most one chunk per step.
When the pool runs out of blocks the lowest-priority, most recently admitted
running request is preempted: its blocks are freed and it goes back to the
front of its priority class, to be recomputed (mostly from the prefix cache).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field

from ember.config import EngineConfig
from ember.engine.block_pool import Block
from ember.engine.kv_cache import KVCacheManager
from ember.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    """``num_new_tokens`` of the request's own tokens, then (decodes only) its draft's tokens."""

    request: Request
    num_new_tokens: int
    num_draft_tokens: int = 0


@dataclass
class SchedulerOutput:
    """The work of one step: decodes first, then prefill chunks."""

    decodes: list[ScheduledRequest] = field(default_factory=list)
    prefills: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens + s.num_draft_tokens for s in (*self.decodes, *self.prefills))

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    """Owns the waiting queue and the running set; see the module docstring."""

    def __init__(self, config: EngineConfig, kv: KVCacheManager, lookup_prefix: Callable[[Request], list[Block]] | None = None) -> None:
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        self.kv = kv
        # Where an admitted request's cached prefix comes from: the pool, or the pool and the session tiers.
        self.lookup_prefix = lookup_prefix or kv.find_cached_prefix
        # Sorted by (priority, seq_no): the head is the next to admit.
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._next_seq_no = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def add(self, request: Request) -> None:
        request.seq_no = self._next_seq_no
        self._next_seq_no += 1
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        keys = [(r.priority, r.seq_no) for r in self.waiting]
        self.waiting.insert(bisect.bisect(keys, (request.priority, request.seq_no)), request)

    def remove(self, request: Request) -> None:
        """Take a request out of the queues and free its blocks (finish or abort)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: set[str] = set()

        # Decodes first, then prefills still catching up; both in admission order.
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        catching_up = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for request in decodes + catching_up:
            if budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            drafted = self._fit_draft(request, budget) if request in decodes else 0
            allocated = drafted > 0 or self.kv.allocate(request, n)
            while not allocated:
                victim = self._pick_victim(exclude=scheduled)
                if victim is None:
                    break
                self._preempt(victim, out)
                if victim is request:
                    break
                allocated = self.kv.allocate(request, n)
            if not allocated:
                continue
            item = ScheduledRequest(request, n, drafted)
            (out.decodes if n == 1 and request in decodes else out.prefills).append(item)
            scheduled.add(request.request_id)
            self.kv.publish_scheduled(request, n)
            budget -= n + drafted

        # Admit waiting requests, unless this step already had to preempt.
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            cached = self.lookup_prefix(request) if request.num_computed_tokens == 0 else []
            num_cached = len(cached) * self.kv.block_size
            n = min(request.num_tokens - num_cached, budget)
            if not self.kv.allocate(request, n, cached):
                break
            self.waiting.pop(0)
            if request.status == RequestStatus.WAITING:  # first admission, not a resume
                self.kv.record_prefix_query(request)
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.prefills.append(ScheduledRequest(request, n))
            self.kv.publish_scheduled(request, n)  # the next admissions of this step may share them
            budget -= n
        return out

    def _fit_draft(self, request: Request, budget: int) -> int:
        """Draft tokens this decode verifies this step, its blocks allocated; 0 (draft dropped) when they do not fit.

        A draft is a bet: it takes only budget that is left and blocks that are
        free (no session is demoted and nobody preempted for a guess).
        """
        draft = request.draft
        if draft is None:
            return 0
        n = 1 + len(draft.tokens)
        if n <= budget and self.kv.can_allocate(request, n) and self.kv.allocate(request, n):
            return len(draft.tokens)
        request.draft = None
        return 0

    def _pick_victim(self, exclude: set[str]) -> Request | None:
        """Lowest priority first, then the most recently admitted; never one already scheduled."""
        candidates = [r for r in self.running if r.request_id not in exclude]
        if not candidates:
            return None
        return max(candidates, key=lambda r: (r.priority, r.seq_no))

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.draft = None
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        out.preempted.append(request)
        self._enqueue(request)
