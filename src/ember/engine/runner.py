"""Turn a ``SchedulerOutput`` into one batched forward pass and sampled tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ember.engine.constraints import fill_token_masks
from ember.engine.kv_cache import KVCacheManager
from ember.engine.request import Request, TokenLogprob
from ember.engine.sampler import Sampler
from ember.engine.scheduler import SchedulerOutput
from ember.model.llama import AttentionMetadata, LlamaModel, PrefillSegment


@dataclass
class RunnerOutput:
    """Sampled tokens of the requests whose scheduled tokens reached their end.

    A decode that verified a draft is not sampled here: ``verify`` holds its
    logits, one row per position (its own token, then each draft token), for
    the engine to accept in order (``LLMEngine._accept_draft``).
    """

    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    verify: dict[str, torch.Tensor] = field(default_factory=dict)
    num_tokens: int = 0


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVCacheManager, device: torch.device) -> None:
        self.model = model
        self.kv = kv
        self.device = device
        self.sampler = Sampler()
        self.block_size = kv.block_size
        self._offsets = torch.arange(self.block_size, device=device)

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Run every scheduled token through the model; sample where a sequence caught up."""
        input_ids, positions, meta, logit_rows, sampled_requests = self._prepare(sched)
        # Grammar masks depend only on tokens already accepted: computed apart
        # from the sampler so they can overlap the forward pass.
        masks = fill_token_masks([r.constraint for r in sampled_requests], self.model.config.vocab_size)
        logits = self.model(input_ids, positions, meta, self.kv.layer_caches, logit_rows)
        out = RunnerOutput(num_tokens=int(input_ids.shape[0]))
        # Logit rows: the sampled requests' first, then each verifying decode's 1 + draft rows.
        row = len(sampled_requests)
        for item in sched.decodes:
            if item.num_draft_tokens:
                out.verify[item.request.request_id] = logits[row : row + 1 + item.num_draft_tokens]
                row += 1 + item.num_draft_tokens
        if sampled_requests:
            tokens, logprobs = self.sampler(logits[: len(sampled_requests)], sampled_requests, masks)
            for request, token, lp in zip(sampled_requests, tokens, logprobs, strict=True):
                out.sampled[request.request_id] = token
                if lp is not None:
                    out.logprobs[request.request_id] = lp
        return out

    def _block_table(self, requests: list[Request]) -> torch.Tensor:
        width = max(len(r.block_ids) for r in requests)
        rows = [r.block_ids + [0] * (width - len(r.block_ids)) for r in requests]
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def _unified_attention(self, meta: AttentionMetadata, sched: SchedulerOutput) -> None:
        """Metadata for one paged attention call over every new token (the batch-invariant path).

        Decode ``i`` (its token, then its draft's) attends on table row ``i``;
        prompt chunk ``j`` on row ``decodes + j``; each token to its context so
        far (position + 1), exactly the context the same token would have if
        it were decoded alone.
        """
        items = [*sched.decodes, *sched.prefills]
        meta.block_tables = self._block_table([item.request for item in items])
        lens: list[int] = []
        rows: list[int] = []
        for j, item in enumerate(items):
            c, n = item.request.num_computed_tokens, item.num_new_tokens + item.num_draft_tokens
            lens.extend(range(c + 1, c + n + 1))
            rows.extend([j] * n)
        meta.token_context_lens = torch.tensor(lens, dtype=torch.long, device=self.device)
        one_token_each = len(rows) == len(items)
        meta.token_table_rows = None if one_token_each else torch.tensor(rows, dtype=torch.long, device=self.device)

    def _context_slots(self, block_table: torch.Tensor, length: int) -> torch.Tensor:
        """Slots of the first ``length`` positions of each row's blocks: (rows, length)."""
        slots = block_table.unsqueeze(-1) * self.block_size + self._offsets
        return slots.view(block_table.shape[0], -1)[:, :length]

    def _prepare(self, sched: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, list[Request]]:
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = []
        sampled: list[Request] = []
        meta = AttentionMetadata(slot_mapping=torch.empty(0), block_size=bs)

        unified = self.model.batch_invariant
        if unified:
            self._unified_attention(meta, sched)
        decodes = [s.request for s in sched.decodes]
        verify_rows: list[int] = []  # after the sampled rows: see RunnerOutput
        if decodes:
            for item in sched.decodes:
                r, p = item.request, item.request.num_computed_tokens
                draft = r.draft.tokens if item.num_draft_tokens and r.draft is not None else []
                rows = verify_rows if draft else logit_rows
                rows.extend(range(len(ids), len(ids) + 1 + len(draft)))
                ids.append(r.token_ids[p])
                ids.extend(draft)
                pos.extend(range(p, p + 1 + len(draft)))
                slots.extend(r.block_ids[q // bs] * bs + q % bs for q in range(p, p + 1 + len(draft)))
                if not draft:
                    sampled.append(r)
            meta.num_decode_tokens = len(decodes)
            assert unified or not verify_rows, "drafts are verified on the batch-invariant path only"
        if decodes and not unified:  # the unified path set its lengths per token in _unified_attention
            ctx_lens = [r.num_computed_tokens + 1 for r in decodes]
            table = self._block_table(decodes)
            lens = torch.tensor(ctx_lens, device=self.device)
            if self.model.kernels is not None:  # the fused kernel reads block tables directly
                meta.decode_block_tables, meta.decode_context_lens = table, lens
            else:
                longest = max(ctx_lens)
                meta.decode_slots = self._context_slots(table, longest)
                meta.decode_mask = (torch.arange(longest, device=self.device) < lens[:, None]).view(len(decodes), 1, 1, longest)

        for item in sched.prefills:
            r, n = item.request, item.num_new_tokens
            start, c = len(ids), r.num_computed_tokens
            ids.extend(r.token_ids[c : c + n])
            pos.extend(range(c, c + n))
            blocks = r.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(c, c + n))
            seg = PrefillSegment(start=start, end=start + n)
            if c > 0 and not unified:
                table = torch.tensor([blocks], dtype=torch.long, device=self.device)
                seg.context_slots = self._context_slots(table, c + n)[0]
                q_pos = torch.arange(c, c + n, device=self.device)
                seg.mask = torch.arange(c + n, device=self.device)[None, :] <= q_pos[:, None]
            meta.prefills.append(seg)
            if c + n == r.num_tokens:
                logit_rows.append(start + n - 1)
                sampled.append(r)

        def longs(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        meta.slot_mapping = longs(slots)
        return longs(ids), longs(pos), meta, longs(logit_rows + verify_rows), sampled
