"""One request as the benchmark saw it: timestamps, token counts and the outcome.

Every time is in seconds on the run's monotonic clock (``time.perf_counter``
minus the run's start), so a saved trace is readable and its numbers can be
checked by hand. Derived latencies (TTFT, E2E, ITL, TPOT) are properties
computed from those timestamps; ``metrics.py`` aggregates them.

Invariant: ``start_s <= chunk_times_s[0] <= ... <= chunk_times_s[-1] <= end_s``
for a finished request. ``chunk_times_s`` holds the arrival time of every chunk
that carried visible text (a non-empty content delta); the role-only first
chunk, the finish chunk and the usage chunk carry none and are not listed.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any


class Clock:
    """Seconds since the clock was made, on ``time.perf_counter`` (monotonic, high resolution)."""

    def __init__(self) -> None:
        self.origin = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.origin


@dataclass
class RequestRecord:
    """Timing and outcome of one chat completion request.

    ``error_kind`` is ``None`` for a success, else a short stable label:
    ``http_<status>`` (e.g. ``http_429``), ``timeout``, ``connect``,
    ``disconnect``, ``stream_error`` (an error object inside a 200 stream),
    ``incomplete`` (a stream that ended without a finish) or ``bad_response``
    (a body that is not the OpenAI format).
    """

    index: int
    group: str = ""
    stream: bool = True
    max_tokens: int | None = None
    conversation_id: int | None = None
    turn: int | None = None
    session_id: str | None = None
    # When an open-loop generator meant to send it; equals start_s in a closed loop.
    scheduled_s: float = 0.0
    start_s: float = 0.0
    end_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    status: int | None = None
    error_kind: str | None = None
    error: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None
    # "usage" when the server reported completion_tokens, "chunks" when counted here.
    output_tokens_source: str | None = None
    finish_reason: str | None = None
    # Ember says why a "length" finish happened (e.g. "timeout" for a deadline).
    stop_reason: str | None = None
    output_text: str = ""
    # Connection set-up this request paid for (None: it reused a pooled connection).
    connect_s: float | None = None
    tls_s: float | None = None

    @property
    def ok(self) -> bool:
        """True when the request completed without any error."""
        return self.error_kind is None and self.end_s is not None

    @property
    def e2e_s(self) -> float | None:
        """End-to-end latency: from sending the request to the last byte of the reply."""
        if self.end_s is None:
            return None
        return self.end_s - self.start_s

    @property
    def ttft_s(self) -> float | None:
        """Time to first token: from sending to the first chunk with visible text.

        A non-streamed reply shows its first text when the whole body arrives,
        so there the first chunk time is the end time (see ``sender.py``).
        """
        if not self.chunk_times_s:
            return None
        return self.chunk_times_s[0] - self.start_s

    @property
    def itl_s(self) -> list[float]:
        """Inter-token latencies: gaps between consecutive text chunks (empty for one chunk)."""
        times = self.chunk_times_s
        return [later - earlier for earlier, later in itertools.pairwise(times)]

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (E2E - TTFT) / (output_tokens - 1).

        Undefined (None) for a non-streamed reply, for fewer than two output
        tokens, or when the request failed; this is vLLM's definition.
        """
        if not self.ok or not self.stream or self.output_tokens is None or self.output_tokens < 2:
            return None
        e2e, ttft = self.e2e_s, self.ttft_s
        if e2e is None or ttft is None:
            return None
        return (e2e - ttft) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of the stored fields (derived latencies are added for readers)."""
        data = asdict(self)
        data["ttft_s"] = self.ttft_s
        data["e2e_s"] = self.e2e_s
        data["tpot_s"] = self.tpot_s
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestRecord:
        """Inverse of ``to_dict``; derived and unknown keys are ignored."""
        names = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in names})


def save_records(records: list[RequestRecord], path: Path) -> None:
    """Write ``records`` as a JSON list (``requests.json``)."""
    path.write_text(json.dumps([r.to_dict() for r in records], indent=1) + "\n")


def load_records(path: Path) -> list[RequestRecord]:
    """Read a JSON list written by ``save_records`` (or by hand, as test traces are)."""
    return [RequestRecord.from_dict(item) for item in json.loads(path.read_text())]
