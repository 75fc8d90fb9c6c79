"""Speculative decoding without a draft model: drafts from the request's own text.

A decode step on a CPU reads every weight once whatever the number of rows,
so a row costs far less in a step that carries several (on the 2-core
machines here: one row ~10 ms, 8 rows ~21 ms), and checking ``k`` guessed
tokens costs a fraction of ``k`` steps. The guesses come from text the answer
is likely to repeat: the tokens that followed the latest earlier occurrence of
the sequence's last n-gram in its prompt and output (prompt lookup), or in the
client's ``prediction`` (OpenAI's Predicted Outputs), preferred unless the
answer's own text matches a longer n-gram.

Exactness, the invariant the engine keeps (``LLMEngine._accept_draft``): the
verify pass computes each row's logits exactly as a one-token decode would
(batch-invariant kernels: a row's numbers do not depend on the rows beside
it), and the engine draws each position's token with the request's own
sampler and generator, in order, stopping at the first draw that differs from
the draft. Every emitted token is therefore the token plain decoding would
have emitted: greedy output is identical, and a seeded request consumes its
generator once per emitted token, as without speculation. (Matching a fixed
draft this way is rejection sampling with a one-hot proposal: the draft token
is kept with probability p(d); otherwise the token is a draw from p without d.)

This module holds the pure decisions: where a draft comes from and how long it
is. It never touches the model.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

# Steps without drafting after a draft whose first token was rejected at length 1:
# open-ended text rarely repeats itself, and a wasted verify row costs ~10 % of a step.
PAUSE_STEPS = 16
# A request's first draft: short, since open-ended text wastes it; a grounded
# answer doubles it to the maximum within two steps.
START_TOKENS = 2
# Drafts ride along while a step has at most this many rows (decodes and draft
# tokens together): one decode row costs ~10 ms here, 16 rows ~34 ms, 32 rows
# ~53 ms (2 cores). With 16 streams decoding, a draft would take rows that cost
# nearly as much as the tokens they might save, so drafts then stop.
STEP_ROWS = 16


def share_draft_rows(wanted: list[int], num_decodes: int) -> list[int]:
    """How many draft tokens each speculating decode may verify this step, in running order.

    The rows a step has left under ``STEP_ROWS`` go to the decodes in turn,
    each taking what it wants while rows remain.
    """
    left = max(0, STEP_ROWS - num_decodes)
    granted = []
    for n in wanted:
        granted.append(min(n, left))
        left -= granted[-1]
    return granted


@dataclass(frozen=True)
class Match:
    """Tokens that followed an earlier occurrence of the context's last ``n`` tokens, from ``start``."""

    tokens: list[int]
    start: int
    n: int


class NgramIndex:
    """Where each n-gram (``min_n``..``max_n`` tokens) of a growing token list was followed by a token.

    Invariant: ``_starts[g]`` lists, ascending, every index ``i`` such that
    ``tokens[i - n:i] == g`` and ``tokens[i]`` exists. The n-gram that ends the
    list has no follower yet, so a lookup with the list's own tail finds an
    earlier occurrence, never itself.
    """

    def __init__(self, min_n: int, max_n: int, tokens: Sequence[int] = ()) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._starts: dict[tuple[int, ...], list[int]] = {}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            i = len(self.tokens)
            for n in range(self.min_n, min(self.max_n, i) + 1):
                self._starts.setdefault(tuple(self.tokens[i - n : i]), []).append(i)
            self.tokens.append(token)

    def propose(self, context: Sequence[int], k: int, after: int | None = None) -> Match:
        """Up to ``k`` tokens that followed the longest n-gram ending ``context``.

        ``after=None`` takes the latest occurrence (recent text repeats best);
        otherwise the first one at or after ``after`` (a prediction is read in
        order), else the latest. An empty match when nothing matches.
        """
        for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
            starts = self._starts.get(tuple(context[len(context) - n :]))
            if not starts:
                continue
            start = starts[-1]
            if after is not None and (j := bisect.bisect_left(starts, after)) < len(starts):
                start = starts[j]
            return Match(self.tokens[start : start + k], start, n)
        return Match([], -1, 0)


@dataclass(frozen=True)
class Draft:
    """Tokens guessed to come next, and whether they came from the client's prediction."""

    tokens: list[int]
    from_prediction: bool = False
    start: int = -1  # where they start in their source


@dataclass(frozen=True)
class SpeculationReport:
    """A request's speculative decoding so far, as its outputs report it."""

    draft_tokens: int  # drafted and verified
    accepted_tokens: int  # of those, kept
    # OpenAI's Predicted Outputs; None when the request sent no prediction.
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None


class RequestSpeculation:
    """One request's drafting state: its indexes, its adaptive draft length and its counters.

    The draft length adapts to what the request's text does: it starts at
    ``START_TOKENS``, a draft taken in full doubles the next one (up to
    ``max_tokens``), a draft whose first token is rejected halves it, and at
    zero the request pauses ``PAUSE_STEPS`` steps before trying one token again. Open-ended chat thus drafts rarely
    and briefly; a rewrite that copies its input drafts at full length.
    """

    def __init__(self, max_tokens: int, min_n: int, max_n: int, prediction: Sequence[int] | None = None) -> None:
        """``max_tokens=0``: never drafts (a constrained request), still reports its prediction as rejected."""
        self.max_tokens = max(0, max_tokens)
        self.length = min(START_TOKENS, self.max_tokens)
        self.paused = 0
        self.context = NgramIndex(min_n, max_n)
        self.prediction = NgramIndex(1, max_n, prediction) if prediction else None
        self.prediction_size = len(prediction or ())
        self._prediction_cursor = 0
        self.drafted = 0
        self.accepted = 0
        self.accepted_from_prediction = 0

    @property
    def wanted(self) -> int:
        """The draft length this request would take next step (0 while paused)."""
        return 0 if self.paused > 0 or self.max_tokens <= 0 else self.length

    def propose(self, token_ids: Sequence[int], limit: int) -> Draft | None:
        """The draft for the next step (at most ``limit`` tokens), or None; ``token_ids`` is prompt + output so far.

        The prediction is indexed from single tokens up: the first output
        token (sampled by the prefill) already places the answer in it.
        """
        if self.max_tokens <= 0:  # kept for its prediction's counters only
            return None
        self.context.extend(token_ids[len(self.context.tokens) :])
        if self.paused > 0:
            self.paused -= 1
            return None
        k = min(self.length, limit)
        if k <= 0:
            return None
        found = self.context.propose(token_ids, k)
        if self.prediction is not None:
            # The prediction, unless the answer's own text matches a longer n-gram.
            predicted = self.prediction.propose(token_ids, k, after=self._prediction_cursor)
            if predicted.tokens and predicted.n >= found.n:
                return Draft(predicted.tokens, from_prediction=True, start=predicted.start)
        return Draft(found.tokens, start=found.start) if found.tokens else None

    def record(self, draft: Draft, accepted: int) -> None:
        """Adapt to how much of ``draft`` the model kept; see the class docstring."""
        self.drafted += len(draft.tokens)
        self.accepted += accepted
        if draft.from_prediction:
            self.accepted_from_prediction += accepted
            self._prediction_cursor = draft.start + accepted
        if accepted == len(draft.tokens):
            self.length = min(2 * self.length, self.max_tokens)
        elif accepted == 0:
            self.length //= 2
            if self.length == 0:
                self.paused, self.length = PAUSE_STEPS, 1

    def report(self) -> SpeculationReport:
        """The counters as a request's outputs carry them."""
        predicted = self.prediction is not None
        return SpeculationReport(
            self.drafted,
            self.accepted,
            self.accepted_from_prediction if predicted else None,
            self.rejected_prediction_tokens if predicted else None,
        )

    @property
    def rejected_prediction_tokens(self) -> int:
        """Prediction tokens that did not become part of the answer (OpenAI's ``rejected_prediction_tokens``)."""
        return max(0, self.prediction_size - self.accepted_from_prediction)
