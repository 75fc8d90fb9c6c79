"""Grammar-constrained decoding: the only module that knows the grammar library.

A request that must follow a grammar (a JSON schema, "any JSON object", or the
tool-call format of ``server/tools.py``) carries a ``Constraint`` on its engine
``Request``. Each step:

1. ``fill_token_masks(constraints, vocab_size)`` computes, for the constrained
   rows about to be sampled, which tokens the grammar allows next. It is a
   separate call so it can run while the forward pass does (the mask depends
   only on tokens already accepted, never on this step's logits).
2. The sampler sets every other token's logit to -inf on those rows (a batch
   mixes constrained and free rows; free rows are untouched).
3. The engine hands the sampled token to ``Constraint.accept``; once
   ``is_terminated()`` the request finishes with reason "stop".

The library is llguidance (an optional extra, ``ember[structured]``); README
"Structured outputs" has the measurements behind that choice. Grammars are
compiled on the server's event loop (``GrammarCompiler.compile``, ~1-3 ms), so
a bad schema is a 400 before the request is admitted and the engine thread
never compiles anything.

Invariant: a Constraint has accepted exactly the request's output tokens, in
order. ``rollback`` undoes the last ones (speculative decoding verifies several
drafted tokens and must undo those it rejects).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from ember.errors import EmberError, InvalidSamplingParamsError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions
    from tokenizers import Tokenizer as HFTokenizer

log = logging.getLogger("ember.engine")

INSTALL_HINT = "pip install 'ember[structured]'"
# Compiled grammars kept for reuse (n > 1 copies, repeated schemas, tool sets).
_CACHE_ENTRIES = 64


class GrammarUnavailableError(EmberError):
    """The grammar library (the ``structured`` extra) is not installed."""


class InvalidGrammarError(InvalidSamplingParamsError):
    """A schema or grammar the library cannot compile; ``param`` names the request field."""


def is_available() -> bool:
    """Whether the grammar library is importable (the ``ember[structured]`` extra)."""
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match, independent of the library.

    ``kind`` is "json_schema" (``source`` is the schema as JSON text),
    "json_object" (any JSON object) or "lark" (``source`` is a Lark grammar in
    llguidance's dialect, which can embed JSON schemas with ``%json {...}``).
    JSON is generated compact (no whitespace between tokens): a small model
    left free to emit whitespace can loop on newlines until max_tokens.
    """

    kind: Literal["json_schema", "json_object", "lark"]
    source: str = ""

    @classmethod
    def json_schema(cls, schema: dict[str, Any]) -> GrammarSpec:
        return cls("json_schema", json.dumps(schema, sort_keys=False, separators=(",", ":")))

    @classmethod
    def json_object(cls) -> GrammarSpec:
        return cls("json_object")

    @classmethod
    def lark(cls, grammar: str) -> GrammarSpec:
        return cls("lark", grammar)


# JSON options of every schema: compact separators, no free whitespace.
COMPACT_JSON: JsonCompileOptions = {"whitespace_flexible": False}


class Constraint:
    """One request's grammar state: which tokens may come next, and what came so far."""

    __slots__ = ("_eos_token_id", "_matcher", "num_accepted")

    def __init__(self, matcher: Any, eos_token_id: int) -> None:
        self._matcher = matcher
        self._eos_token_id = eos_token_id
        self.num_accepted = 0

    def fill_next_token_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32 words, bit ``t % 32`` of word ``t // 32``).

        A matcher in an error state (which sampling from its own masks cannot
        reach) allows only EOS, so the request ends instead of sampling from an
        empty distribution.
        """
        target = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * target.element_size())
        if self._matcher.is_error():
            log.warning("grammar matcher in error state: %s", self._matcher.get_error())
            target.zero_()
            target[self._eos_token_id // 32] = 1 << (self._eos_token_id % 32)

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False if the grammar does not allow it."""
        ok = bool(self._matcher.consume_token(token_id))
        if ok:
            self.num_accepted += 1
        return ok

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_accepted} accepted tokens")
        if num_tokens and not self._matcher.rollback(num_tokens):
            raise RuntimeError(f"grammar rollback failed: {self._matcher.get_error()}")
        self.num_accepted -= num_tokens

    def is_terminated(self) -> bool:
        """True once the grammar is complete and allows nothing more (not even optional text)."""
        return bool(self._matcher.is_stopped())

    def is_accepting(self) -> bool:
        """True when the output so far is a complete match (more may still be allowed)."""
        return bool(self._matcher.is_accepting())


class GrammarCompiler:
    """Compiles ``GrammarSpec``s into ``Constraint``s for one tokenizer.

    Building the library's tokenizer view takes ~0.3 s, so one compiler lives
    as long as the engine. ``compile`` may be called from any thread; each
    Constraint it returns is then used by one thread at a time (the engine's).
    """

    def __init__(self, hf_tokenizer: HFTokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        try:
            import llguidance
        except ImportError as exc:
            raise GrammarUnavailableError(f"Structured outputs need the grammar library: {INSTALL_HINT}.") from exc
        self._llg = llguidance
        self.vocab_size = vocab_size
        self.eos_token_id = int(eos_token_ids[0])
        self._tokenizer = llguidance.LLTokenizer(hf_tokenizer.to_str(), n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self._compiled: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec, param: str = "response_format") -> Constraint:
        """A fresh Constraint for ``spec``; ``InvalidGrammarError`` (naming ``param``) if it does not compile."""
        with self._lock:
            template = self._compiled.get(spec)
            if template is not None:
                self._compiled.move_to_end(spec)
        if template is None:
            template = self._llg.LLMatcher(self._tokenizer, self._grammar_text(spec, param), log_level=0)
            if template.is_error():
                raise InvalidGrammarError(f"The {_describe(spec)} cannot be used: {_first_line(template.get_error())}", param)
            with self._lock:
                self._compiled[spec] = template
                while len(self._compiled) > _CACHE_ENTRIES:
                    self._compiled.popitem(last=False)
        return Constraint(template.deep_copy(), self.eos_token_id)

    def _grammar_text(self, spec: GrammarSpec, param: str) -> str:
        grammar_from_json_schema = self._llg.LLMatcher.grammar_from_json_schema
        try:
            if spec.kind == "json_object":
                return grammar_from_json_schema({"type": "object"}, defaults=COMPACT_JSON)
            if spec.kind == "json_schema":
                return grammar_from_json_schema(spec.source, defaults=COMPACT_JSON)
            return spec.source
        except ValueError as exc:  # the library rejects the schema while translating it
            raise InvalidGrammarError(f"The {_describe(spec)} cannot be used: {_first_line(str(exc))}", param) from None


@dataclass
class TokenMasks:
    """Allowed next tokens of some rows of a step: ``allowed[i]`` belongs to logits row ``rows[i]``."""

    rows: list[int]
    allowed: torch.Tensor  # bool (len(rows), vocab_size)


def fill_token_masks(constraints: Sequence[Constraint | None], vocab_size: int) -> TokenMasks | None:
    """Masks of the constrained rows among the rows about to be sampled (one constraint or None each).

    None when no request is constrained, so free batches pay nothing. The
    result depends only on tokens already accepted, so this may run before or
    alongside the forward pass of the same step.
    """
    rows = [i for i, c in enumerate(constraints) if c is not None]
    if not rows:
        return None
    words = (vocab_size + 31) // 32
    bitmask = torch.empty((len(rows), words), dtype=torch.int32)
    for k, i in enumerate(rows):
        constraints[i].fill_next_token_mask(bitmask, k)  # type: ignore[union-attr]
    # Bit b of int32 word w is token 32*w + b; on a little-endian machine that
    # is bit b%8 of byte 4*w + b//8, which is what unpackbits(..., "little") yields.
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
    return TokenMasks(rows, torch.from_numpy(bits.view(np.bool_)))


def _describe(spec: GrammarSpec) -> str:
    return {"json_schema": "JSON schema", "json_object": "JSON object grammar", "lark": "tool-call grammar"}[spec.kind]


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "unknown error"
