"""Benchmark metrics, defined the way vLLM's serving benchmark defines them.

Pure functions of ``RequestRecord``s and a run duration, so they can be
checked by hand on a recorded trace:

- TTFT: time from sending a request to its first chunk with visible text.
- TPOT: per request, (E2E - TTFT) / (output_tokens - 1); requests with fewer
  than two output tokens have none.
- ITL: every gap between consecutive text chunks, pooled over all requests
  (so a long reply weighs more than a short one, as in vLLM).
- E2E: time from sending a request to the end of its reply.
- Request throughput: completed requests / duration; token throughputs count
  the tokens of completed requests only.
- Goodput: completed requests meeting every given SLO / duration.

Statistics are the mean and the 50th, 90th and 99th percentiles, percentiles
with linear interpolation between closest ranks (numpy's default, vLLM's too).
Latency statistics use successful requests only; failures are counted by kind.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ember.bench.record import RequestRecord

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Stats:
    """Mean and percentiles of some latencies in seconds; all None when there were none."""

    count: int
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation; ``values`` must not be empty."""
    if not values:
        raise ValueError("percentile of no values")
    return float(np.percentile(np.asarray(values, dtype=float), q))


def describe(values: Iterable[float]) -> Stats:
    """``Stats`` of ``values`` (count, mean, p50, p90, p99)."""
    data = [float(v) for v in values]
    if not data:
        return Stats(count=0)
    p50, p90, p99 = (percentile(data, q) for q in PERCENTILES)
    return Stats(count=len(data), mean=float(np.mean(data)), p50=p50, p90=p90, p99=p99)


@dataclass(frozen=True)
class SLO:
    """Service-level objectives in seconds; a request is "good" when it meets every one given."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    @property
    def empty(self) -> bool:
        return self.ttft_s is None and self.tpot_s is None and self.e2e_s is None

    def met_by(self, record: RequestRecord) -> bool:
        """True when ``record`` succeeded and meets every objective.

        A request without the measured value (e.g. no TPOT for a one-token
        reply) cannot be shown to meet that objective, so it does not.
        """
        if not record.ok:
            return False
        for limit, value in ((self.ttft_s, record.ttft_s), (self.tpot_s, record.tpot_s), (self.e2e_s, record.e2e_s)):
            if limit is not None and (value is None or value > limit):
                return False
        return True

    def to_dict(self) -> dict[str, float]:
        return {key: value for key, value in asdict(self).items() if value is not None}

    def __str__(self) -> str:
        return ", ".join(f"{key.removesuffix('_s')} ≤ {value:g} s" for key, value in self.to_dict().items()) or "none"


_SLO_ITEM = re.compile(r"^(ttft|tpot|e2e)=([0-9]*\.?[0-9]+)(ms|s)?$")


def parse_slo(text: str | None) -> SLO:
    """Parse ``"ttft=0.5,e2e=5"`` (seconds; a value may end in ``ms`` or ``s``)."""
    if not text:
        return SLO()
    values: dict[str, float] = {}
    for item in text.replace(" ", "").split(","):
        match = _SLO_ITEM.match(item)
        if match is None:
            raise ValueError(f"bad SLO item {item!r}: expected ttft=, tpot= or e2e= with a number of seconds, e.g. ttft=0.5,e2e=5")
        name, number, unit = match.groups()
        values[f"{name}_s"] = float(number) / (1000.0 if unit == "ms" else 1.0)
    return SLO(**values)


@dataclass(frozen=True)
class Summary:
    """Aggregate metrics of one group of requests run over ``duration_s`` seconds."""

    requests: int
    completed: int
    failed: int
    errors_by_kind: dict[str, int]
    duration_s: float
    prompt_tokens: int
    output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft: Stats
    tpot: Stats
    itl: Stats
    e2e: Stats
    # Goodput is None when no SLO was given.
    good_requests: int | None = None
    goodput: float | None = None
    slo: dict[str, float] = field(default_factory=dict)
    # How completed requests ended: "length", "stop", "length/timeout" (see finish_reasons).
    finish_reasons: dict[str, int] = field(default_factory=dict)
    # Connection set-up: requests that opened a connection, and what it cost.
    new_connections: int = 0
    connect: Stats = Stats(count=0)
    tls: Stats = Stats(count=0)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Summary:
        stats_fields = ("ttft", "tpot", "itl", "e2e", "connect", "tls")
        values: dict[str, Any] = {key: (Stats(**value) if key in stats_fields else value) for key, value in data.items()}
        return cls(**values)


def span_s(records: Sequence[RequestRecord]) -> float:
    """Seconds from the first request's start to the last request's end (0 for none)."""
    ends = [r.end_s for r in records if r.end_s is not None]
    if not records or not ends:
        return 0.0
    return max(ends) - min(r.start_s for r in records)


def errors_by_kind(records: Iterable[RequestRecord]) -> dict[str, int]:
    """How many requests failed, by ``error_kind`` (sorted by kind)."""
    counts = Counter(r.error_kind or "unfinished" for r in records if not r.ok)
    return dict(sorted(counts.items()))


def finish_reasons(records: Iterable[RequestRecord]) -> dict[str, int]:
    """How the completed requests ended, by ``finish_reason``.

    A "length" finish with a ``stop_reason`` (Ember's "timeout": a deadline cut
    the reply) is counted as e.g. ``length/timeout``, apart from max_tokens cuts.
    """

    def reason(record: RequestRecord) -> str:
        finish = record.finish_reason or "none"
        return f"{finish}/{record.stop_reason}" if finish == "length" and record.stop_reason else finish

    return dict(sorted(Counter(reason(r) for r in records if r.ok).items()))


def summarize(records: Sequence[RequestRecord], duration_s: float | None = None, slo: SLO = SLO()) -> Summary:
    """Every metric of ``records``; ``duration_s`` defaults to their span (see ``span_s``).

    Pass the wall time the load generator ran when you have it: it also counts
    time when nothing was in flight (e.g. an open loop waiting for arrivals).
    """
    duration = span_s(records) if duration_s is None else duration_s
    done = [r for r in records if r.ok]
    prompt_tokens = sum(r.prompt_tokens or 0 for r in done)
    output_tokens = sum(r.output_tokens or 0 for r in done)

    def per_second(amount: float) -> float:
        return amount / duration if duration > 0 else math.nan

    good = None if slo.empty else sum(1 for r in done if slo.met_by(r))
    opened = [r for r in records if r.connect_s is not None]
    return Summary(
        requests=len(records),
        completed=len(done),
        failed=len(records) - len(done),
        errors_by_kind=errors_by_kind(records),
        duration_s=duration,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        request_throughput=per_second(len(done)),
        output_throughput=per_second(output_tokens),
        total_token_throughput=per_second(prompt_tokens + output_tokens),
        ttft=describe(r.ttft_s for r in done if r.ttft_s is not None),
        tpot=describe(r.tpot_s for r in done if r.tpot_s is not None),
        itl=describe(gap for r in done for gap in r.itl_s),
        e2e=describe(r.e2e_s for r in done if r.e2e_s is not None),
        good_requests=good,
        goodput=None if good is None else per_second(good),
        slo=slo.to_dict(),
        finish_reasons=finish_reasons(records),
        new_connections=len(opened),
        connect=describe(r.connect_s for r in opened if r.connect_s is not None),
        tls=describe(r.tls_s for r in opened if r.tls_s is not None),
    )


def stats_by(
    records: Iterable[RequestRecord],
    key: Callable[[RequestRecord], Hashable],
    value: Callable[[RequestRecord], float | None],
) -> dict[Any, Stats]:
    """``Stats`` of ``value`` for the successful records, per ``key`` (sorted by key).

    E.g. TTFT per conversation turn: ``stats_by(records, lambda r: r.turn, lambda r: r.ttft_s)``.
    """
    buckets: dict[Any, list[float]] = {}
    for record in records:
        measured = value(record) if record.ok else None
        if measured is not None:
            buckets.setdefault(key(record), []).append(measured)
    return {k: describe(buckets[k]) for k in sorted(buckets)}
