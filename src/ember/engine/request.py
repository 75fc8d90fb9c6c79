"""A request's state inside the engine, and what the engine reports back.

The one scheduling rule (ARCHITECTURE.md): a request has ``num_computed_tokens``
and catches up to ``num_tokens``. Prefill, chunked prefill, prefix hits and
decode differ only in how far behind it is.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ember.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from ember.engine.constraints import Constraint
    from ember.engine.speculation import Draft, RequestSpeculation, SpeculationReport


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an EOS or stop token
    STOP_STRING = "stop_string"  # a stop string matched
    LENGTH = "length"  # max_tokens or the context end
    TIMEOUT = "timeout"  # the request's deadline passed
    ABORT = "abort"  # cancelled by the caller

    @property
    def openai(self) -> str:
        """OpenAI's finish_reason; a timeout reads as "length" (see server docs)."""
        return {"stop": "stop", "stop_string": "stop", "length": "length", "timeout": "length", "abort": "abort"}[self.value]


class Priority(enum.IntEnum):
    """Lower value runs first."""

    HIGH = 0
    NORMAL = 1
    LOW = 2


@dataclass
class TokenLogprob:
    """Log-probability of a generated token and the ``k`` most likely alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestTimes:
    """Clock readings (engine clock, seconds) of a request's life."""

    arrival: float
    scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    last_token: float | None = None


class Request:
    """Mutable engine-side state of one generation request."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        *,
        priority: int = Priority.NORMAL,
        deadline: float | None = None,
        eos_token_ids: tuple[int, ...] = (),
        max_model_len: int,
        session_id: str | None = None,
        constraint: Constraint | None = None,
    ) -> None:
        self.request_id = request_id
        self.params = params
        self.priority = int(priority)
        self.deadline = deadline
        self.session_id = session_id
        self.num_prompt_tokens = len(prompt_token_ids)
        # Prompt then output ids, in one list: the scheduler only sees tokens.
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens whose KV came from the cache at admission (prefix reuse), by tier.
        self.num_cached_tokens = 0
        self.cache_tier: str = "cold"
        self.cached_tokens_by_tier: dict[str, int] = {}
        self.block_ids: list[int] = []
        # Chained hashes of this request's full blocks (filled lazily by the KV manager).
        self.block_hashes: list[bytes] = []
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None
        self.num_preemptions = 0
        self.times = RequestTimes(arrival=arrival_time)
        self.logprobs: list[TokenLogprob] = []
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed % 2**64)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(eos_token_ids)
        self.stop_token_ids = frozenset(stop_ids)
        budget = max_model_len - self.num_prompt_tokens
        self.max_tokens = budget if params.max_tokens is None else min(params.max_tokens, budget)
        # Grammar the output must follow (engine/constraints.py); None for free text.
        self.constraint = constraint
        # Drafting state (engine/speculation.py); None when the request does not speculate.
        self.speculation: RequestSpeculation | None = None
        # This step's guessed next tokens, verified with its decode token; None when not speculating.
        self.draft: Draft | None = None
        # Detokenizer state; owned by detokenizer.py.
        self.detok: Any = None
        # Sequence number for FIFO order within a priority.
        self.seq_no = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, computed={self.num_computed_tokens}/"
            f"{self.num_tokens}, blocks={len(self.block_ids)})"
        )


@dataclass
class RequestOutput:
    """What one engine step produced for one request (incremental)."""

    request_id: str
    text_delta: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    stop_reason: str | int | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    cache_tier: str
    logprobs: list[TokenLogprob]
    times: RequestTimes
    error: str | None = None
    # Speculative decoding so far (engine/speculation.py); None when the request does not speculate.
    speculation: SpeculationReport | None = None
