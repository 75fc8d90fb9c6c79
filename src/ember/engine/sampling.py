"""SamplingParams: how one request picks its tokens and when it stops."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ember.errors import InvalidSamplingParamsError

MAX_TOP_LOGPROBS = 20
# Temperatures below this sample greedily: dividing logits by a subnormal
# temperature overflows to inf and the softmax to NaN.
GREEDY_TEMPERATURE = 1e-5
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
# OpenAI's own limit on logit_bias entries.
MAX_LOGIT_BIAS_ENTRIES = 300


@dataclass
class SamplingParams:
    """Sampling and stopping options of one request (OpenAI semantics where they exist).

    ``temperature`` below ``GREEDY_TEMPERATURE`` (0 included) means greedy. ``top_k <= 0`` disables top-k.
    ``logprobs`` is the number of alternatives to report per token (0 reports
    only the sampled token's log-probability; None reports nothing).
    ``max_tokens=None`` lets the request run to the end of the context.
    """

    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # OpenAI logit_bias: token id -> value in [-100, 100] added to its logit.
    logit_bias: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        stop: Any = self.stop  # callers may pass one string for convenience, whatever the annotation says
        if isinstance(stop, str):
            self.stop = [stop]
        self.stop = [s for s in self.stop if s]
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate(self) -> None:
        """Raise ``InvalidSamplingParamsError`` naming the first out-of-range field."""

        def fail(param: str, message: str) -> None:
            raise InvalidSamplingParamsError(message, param=param)

        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            fail("max_tokens", f"max_tokens must be a positive integer, got {self.max_tokens!r}.")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            fail("min_tokens", f"min_tokens must be >= 0, got {self.min_tokens!r}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens}).")
        if not 0.0 <= self.temperature <= 2.0:
            fail("temperature", f"temperature must be between 0 and 2, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", f"top_p must be in (0, 1], got {self.top_p}.")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            fail("top_k", f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}.")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", f"min_p must be in [0, 1], got {self.min_p}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail("presence_penalty", f"presence_penalty must be between -2 and 2, got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail("frequency_penalty", f"frequency_penalty must be between -2 and 2, got {self.frequency_penalty}.")
        if not 0.01 <= self.repetition_penalty <= 2.0:
            fail("repetition_penalty", f"repetition_penalty must be in [0.01, 2], got {self.repetition_penalty}.")
        if self.seed is not None and (not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**64):
            fail("seed", f"seed must be a 64-bit integer, got {self.seed!r}.")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            fail("top_logprobs", f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {self.logprobs!r}.")
        if len(self.stop) > MAX_STOP_STRINGS:
            fail("stop", f"at most {MAX_STOP_STRINGS} stop sequences are allowed, got {len(self.stop)}.")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            fail("stop", f"stop sequences are limited to {MAX_STOP_STRING_CHARS} characters.")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "stop_token_ids must be non-negative integers.")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            fail("logit_bias", f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {len(self.logit_bias)}.")
        for token, value in self.logit_bias.items():
            if not isinstance(token, int) or token < 0:
                fail("logit_bias", f"logit_bias keys must be token ids (non-negative integers), got {token!r}.")
            if not -100.0 <= value <= 100.0:
                fail("logit_bias", f"logit_bias values must be between -100 and 100, got {value} for token {token}.")
