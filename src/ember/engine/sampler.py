"""Pick each sequence's next token from its logits.

Order of operations per row (vLLM/OpenAI semantics): ``logit_bias`` added and,
on rows that follow a grammar, disallowed tokens set to -inf (the masks come
precomputed from ``engine/constraints.py``); then penalties (repetition over
prompt and output, presence and frequency over output), min_tokens (stop ids
masked until reached), then greedy argmax, or temperature, top-k, top-p, min-p
and a draw from the request's own generator. Seeded requests therefore give the
same tokens whatever else shares the batch.

Reported log-probabilities are those of the model (log-softmax of the raw
logits), as OpenAI reports them, not of the processed distribution.
"""

from __future__ import annotations

from typing import Any

import torch

from ember.engine.constraints import TokenMasks
from ember.engine.request import Request, TokenLogprob

# top-p looks at this many best tokens first and sorts the full vocabulary only
# when they hold less than top_p of the mass: same result, far less sorting.
# Measured over 960 steps of 16 story streams at temperature 0.7 / top_p 0.9:
# no row needed more than 256 candidates (0.3 % needed more than 128); topk's
# cost grows with k (1,024 candidates took a third of a sampled step).
_TOP_P_CANDIDATES = 256
# A flatter row (a high temperature) looks at this many next, before sorting everything.
_WIDE_CANDIDATES = 4096


class Sampler:
    """Stateless; the state that matters (generators, counts) lives on requests."""

    def __call__(
        self, logits: torch.Tensor, requests: list[Request], masks: TokenMasks | None = None
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """Sample one token per row of ``logits`` (N, V), float32; ``masks`` restrict the constrained rows."""
        raw = logits
        logits = _restrict(logits, requests, masks)
        fast = all(
            r.params.greedy and not r.params.needs_penalties and r.params.logprobs is None and not self._masks_stop(r) for r in requests
        )
        if fast:
            return _argmax(logits).tolist(), [None] * len(requests)

        raw_logprobs = None
        if any(r.params.logprobs is not None for r in requests):
            raw_logprobs = torch.log_softmax(raw, dim=-1)
        if logits is raw and self._writes_rows(logits, requests):
            logits = logits.clone()  # the caller's tensor stays as the model produced it
        tokens: list[int] = []
        logprobs: list[TokenLogprob | None] = []
        for i, request in enumerate(requests):
            row = logits[i]
            self._apply_penalties(row, request)
            if self._masks_stop(request):
                row[list(request.stop_token_ids)] = float("-inf")
        # Rows without top-k share one softmax and one candidate selection (batched tensor work).
        batched = [i for i, r in enumerate(requests) if not r.params.greedy and not 0 < r.params.top_k < logits.shape[1]]
        if batched:
            rows = logits if len(batched) == len(requests) else logits[batched]  # a copy only when some rows stay
            drawn = dict(zip(batched, _sample_batch(rows, [requests[i] for i in batched]), strict=True))
        else:
            drawn = {}
        for i, request in enumerate(requests):
            row = logits[i]
            if i in drawn:
                token = drawn[i]
            else:
                token = int(row.argmax()) if request.params.greedy else self._sample(row, request)
            tokens.append(token)
            if raw_logprobs is not None and request.params.logprobs is not None:
                logprobs.append(_token_logprob(raw_logprobs[i], token, request.params.logprobs))
            else:
                logprobs.append(None)
        return tokens, logprobs

    def _writes_rows(self, logits: torch.Tensor, requests: list[Request]) -> bool:
        """Whether sampling these rows writes into ``logits``: penalties, min_tokens
        masks, or the torch path of the batched draw (``sample_rows`` only reads)."""
        if any(r.params.needs_penalties or self._masks_stop(r) for r in requests):
            return True
        return _kernels(logits) is None

    @staticmethod
    def _masks_stop(request: Request) -> bool:
        # A grammar decides on its own when the output may end (min_tokens would
        # otherwise mask the only token a complete match allows).
        return request.num_output_tokens < request.params.min_tokens and bool(request.stop_token_ids) and request.constraint is None

    @staticmethod
    def _apply_penalties(row: torch.Tensor, request: Request) -> None:
        p = request.params
        if not p.needs_penalties:
            return
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(request.token_ids)), dtype=torch.long, device=row.device)
            values = row[seen]
            row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and request.num_output_tokens:
            out = torch.tensor(request.output_token_ids, dtype=torch.long, device=row.device)
            counts = torch.bincount(out, minlength=row.shape[0]).to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)

    @staticmethod
    def _sample(row: torch.Tensor, request: Request) -> int:
        p = request.params
        # Penalties can push logits to +-inf (a tiny repetition penalty divides by
        # almost zero); keep the ordering but stay finite so softmax has no NaN.
        row = torch.nan_to_num(row / p.temperature, nan=-3.0e38, posinf=3.0e38, neginf=-3.0e38)
        if p.top_k > 0 and p.top_k < row.shape[0]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            probs = _top_p(probs, p.top_p)
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        return int(torch.multinomial(probs, 1, generator=request.generator))


def _sample_batch(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """One draw per row of ``logits`` (N, V) at each request's temperature, top_p and min_p (no top_k).

    With the compiled kernels, one call does every row (``sample_rows``,
    kernels/cpu_kernels.cpp: softmax, nucleus, min-p and an inverse-CDF draw
    from one uniform of the row's own generator). Without them the softmax and
    the candidate selection run over all rows at once, then each row draws from
    its own generator over its kept candidates. Either way a seeded row's token
    depends only on its logits and its generator; the two ways draw different
    tokens for one seed (same distribution). ``logits`` is the caller's scratch
    copy: it may be overwritten.
    """
    kernels = _kernels(logits)
    if kernels is not None:
        params = [r.params for r in requests]
        per_row = torch.tensor([[p.temperature, p.top_p, p.min_p] for p in params], dtype=torch.float32).t().contiguous()
        uniforms = torch.cat([torch.rand(1, generator=r.generator) for r in requests])
        return kernels.sample_rows(logits.contiguous(), per_row[0], per_row[1], per_row[2], uniforms).tolist()
    temperatures = torch.tensor([r.params.temperature for r in requests], dtype=logits.dtype, device=logits.device)
    scaled = torch.nan_to_num_(logits.div_(temperatures[:, None]), nan=-3.0e38, posinf=3.0e38, neginf=-3.0e38)
    probs = torch.softmax(scaled, dim=-1)
    k = min(_TOP_P_CANDIDATES, probs.shape[1])
    top_values, top_indices = torch.topk(probs, k) if any(r.params.top_p < 1.0 for r in requests) else (None, None)
    tokens = []
    for i, request in enumerate(requests):
        p = request.params
        values, indices = probs[i], None
        if p.top_p < 1.0:
            assert top_values is not None and top_indices is not None
            if float(top_values[i].sum()) >= p.top_p:
                values, indices = top_values[i], top_indices[i]
            else:  # the candidates hold too little mass: a flatter row
                values, indices = _wide_candidates(probs[i], p.top_p)
            keep = (torch.cumsum(values, dim=0) - values) < p.top_p  # the first token always stays
            values = values * keep
        if p.min_p > 0.0:
            values = values.masked_fill(values < p.min_p * values.max(), 0.0)
        choice = int(torch.multinomial(values, 1, generator=request.generator))
        tokens.append(choice if indices is None else int(indices[choice]))
    return tokens


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)``, the same indices; on CPU one compiled pass per row
    (``argmax_rows``: torch's reduction took ~1.1 ms of a 16-row decode step)."""
    kernels = _kernels(logits) if logits.shape[1] > 0 else None
    if kernels is None:
        return logits.argmax(dim=-1)
    return kernels.argmax_rows(logits.contiguous())


def _kernels(logits: torch.Tensor) -> Any:
    """The compiled CPU kernels if they take ``logits`` (float32 on the CPU), else None
    (also when disabled or unbuildable): imported here, not at module load."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32:
        return None
    from ember.kernels import cpu

    return cpu.load()


def _restrict(logits: torch.Tensor, requests: list[Request], masks: TokenMasks | None) -> torch.Tensor:
    """``logits`` with each row's logit_bias added and its grammar mask applied (a copy if anything changes)."""
    biased = [i for i, r in enumerate(requests) if r.params.logit_bias]
    if not biased and masks is None:
        return logits
    logits = logits.clone()
    for i in biased:
        bias = requests[i].params.logit_bias
        ids = torch.tensor(list(bias), dtype=torch.long, device=logits.device)
        logits[i, ids] += torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
    if masks is not None:
        rows = torch.tensor(masks.rows, dtype=torch.long, device=logits.device)
        logits[rows] = logits[rows].masked_fill(~masks.allowed.to(logits.device), float("-inf"))
    return logits


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero every token outside the smallest set whose mass reaches ``top_p``."""
    k = min(_TOP_P_CANDIDATES, probs.shape[0])
    values, indices = torch.topk(probs, k)
    if k < probs.shape[0] and float(values.sum()) < top_p:
        values, indices = _wide_candidates(probs, top_p)
    cumulative = torch.cumsum(values, dim=0)
    # Keep a token if the mass before it is still below top_p (the first always stays).
    keep = (cumulative - values) < top_p
    kept = torch.zeros_like(probs)
    kept[indices[keep]] = values[keep]
    return kept


def _wide_candidates(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A row's best ``_WIDE_CANDIDATES`` tokens, sorted, when they hold ``top_p`` of its mass; else the whole row sorted."""
    k = min(_WIDE_CANDIDATES, probs.shape[0])
    values, indices = torch.topk(probs, k)
    if k < probs.shape[0] and float(values.sum()) < top_p:
        values, indices = torch.sort(probs, descending=True)
    return values, indices


def _token_logprob(logprobs: torch.Tensor, token: int, k: int) -> TokenLogprob:
    top: list[tuple[int, float]] = []
    if k > 0:
        values, indices = torch.topk(logprobs, k)
        top = list(zip(indices.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token_id=token, logprob=float(logprobs[token]), top=top)
