"""What a soak run measured, and its verdict: pure functions over request records and samples.

``python -m benchmarks soak`` (benchmarks/soak.py) records every request and samples the
server's resident memory, open file descriptors and the session tiers'
bytes; this module turns them into per-minute latency and error figures, the
RSS slope (raw, and net of what the warm tier holds in RAM by design) and a
verdict against the soak's objectives. No I/O, no clock.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

MB = 1024 * 1024


@dataclass(frozen=True)
class SoakRequest:
    """One request of the soak, times in seconds from the start of the run."""

    kind: str  # "stream", "full" or "turn" (a turn of a multi-turn session)
    started_s: float
    e2e_s: float
    ttft_s: float | None
    status: int  # HTTP status; 0 for a transport error
    cancelled: bool = False  # the client left on purpose, mid-request
    error: str | None = None  # why it failed, None when it did not

    @property
    def failed(self) -> bool:
        return self.error is not None and not self.cancelled


@dataclass(frozen=True)
class ResourceSample:
    """The server process at one instant."""

    at_s: float
    rss_bytes: int
    open_fds: int
    warm_ram_bytes: int  # llm_session_bytes{tier="warm"}: the warm tier's RAM, bounded by its budget
    # process_native_heap_bytes: malloc's heap, to tell a leak (in use grows) from fragmentation (free grows).
    heap_in_use_bytes: int = 0
    heap_free_bytes: int = 0


@dataclass
class MinuteStats:
    minute: int
    requests: int
    errors: int
    cancelled: int
    p50_e2e_s: float | None
    p99_e2e_s: float | None
    p50_ttft_s: float | None
    p99_ttft_s: float | None


@dataclass
class SoakVerdict:
    """The soak's objectives, each with what was measured."""

    errors: int
    net_slope_mb_per_min: float | None
    raw_slope_mb_per_min: float | None
    max_rss_bytes: int | None
    rss_bound_bytes: int | None
    fds_first: int | None
    fds_last: int | None
    fds_max: int | None
    checks: dict[str, bool] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(self.checks.values())


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def per_minute(requests: list[SoakRequest]) -> list[MinuteStats]:
    """Requests grouped by the minute they started in; latencies of completed, uncancelled ones."""
    if not requests:
        return []
    last = int(max(r.started_s for r in requests) // 60)
    rows = []
    for minute in range(last + 1):
        group = [r for r in requests if int(r.started_s // 60) == minute]
        ok = [r for r in group if not r.cancelled and r.error is None]
        e2e = [r.e2e_s for r in ok]
        ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
        rows.append(
            MinuteStats(
                minute,
                len(group),
                sum(r.failed for r in group),
                sum(r.cancelled for r in group),
                percentile(e2e, 50),
                percentile(e2e, 99),
                percentile(ttft, 50),
                percentile(ttft, 99),
            )
        )
    return rows


def slope_per_min(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, value) points, in value per minute; None under 2 points."""
    if len(points) < 2:
        return None
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    if var == 0:
        return None
    cov = sum((t - mean_t) * (v - mean_v) for t, v in points)
    return cov / var * 60


def verdict(
    requests: list[SoakRequest],
    samples: list[ResourceSample],
    *,
    warmup_s: float,
    budget_bytes: int,
    max_net_slope_mb_per_min: float = 2.0,
    max_fd_growth: int = 8,
) -> SoakVerdict:
    """Judge a run: 0 errors; net RSS slope after warm-up within bound; raw RSS within the budgets; fds flat.

    ``budget_bytes`` is what the server may add on top of its resting RSS by
    design (the warm tier's RAM budget; the KV pool is allocated at start).
    The bound on raw RSS is the first sample after warm-up plus that budget.
    fds are flat when the last sample exceeds the first after warm-up by at
    most ``max_fd_growth`` (connections come and go).
    """
    steady = [s for s in samples if s.at_s >= warmup_s]
    errors = sum(r.failed for r in requests)
    raw = slope_per_min([(s.at_s, s.rss_bytes / MB) for s in steady])
    net = slope_per_min([(s.at_s, (s.rss_bytes - s.warm_ram_bytes) / MB) for s in steady])
    out = SoakVerdict(errors, net, raw, None, None, None, None, None)
    checks = {"no errors": errors == 0}
    if steady:
        out.max_rss_bytes = max(s.rss_bytes for s in steady)
        out.rss_bound_bytes = steady[0].rss_bytes + budget_bytes
        out.fds_first, out.fds_last, out.fds_max = steady[0].open_fds, steady[-1].open_fds, max(s.open_fds for s in steady)
        checks["raw RSS within the budgets"] = out.max_rss_bytes <= out.rss_bound_bytes
        checks["fds flat"] = out.fds_last - out.fds_first <= max_fd_growth
    checks[f"net RSS slope <= {max_net_slope_mb_per_min:g} MB/min"] = net is not None and net <= max_net_slope_mb_per_min
    out.checks = checks
    return out


def _fmt(value: float | None, scale: float = 1.0, digits: int = 0) -> str:
    return "-" if value is None else f"{value * scale:,.{digits}f}"


def render_markdown(requests: list[SoakRequest], samples: list[ResourceSample], result: SoakVerdict, *, config: dict[str, Any]) -> str:
    """The report: configuration, per-minute table, resources, verdict."""
    lines = ["# python -m benchmarks soak", ""]
    lines.append(", ".join(f"{k} {v}" for k, v in config.items()))
    kinds = {k: sum(r.kind == k for r in requests) for k in ("stream", "full", "turn")}
    cancelled = sum(r.cancelled for r in requests)
    share = cancelled / len(requests) if requests else 0.0
    lines += [
        "",
        (
            f"{len(requests):,} requests ({kinds['stream']:,} streamed, {kinds['full']:,} whole replies, "
            f"{kinds['turn']:,} session turns), {cancelled:,} cancelled by the client ({share:.1%}), {result.errors} errors."
        ),
        "",
    ]
    lines += [
        "| minute | requests | errors | cancelled | p50 e2e ms | p99 e2e ms | p50 TTFT ms | p99 TTFT ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in per_minute(requests):
        lines.append(
            f"| {m.minute} | {m.requests} | {m.errors} | {m.cancelled} | {_fmt(m.p50_e2e_s, 1000)} | {_fmt(m.p99_e2e_s, 1000)} "
            f"| {_fmt(m.p50_ttft_s, 1000)} | {_fmt(m.p99_ttft_s, 1000)} |"
        )
    lines += ["", "| resource | after warm-up | last | max |", "|---|---|---|---|"]
    steady = [s for s in samples if s.at_s >= config.get("warmup_s", 0)]
    if steady:
        first, last = steady[0], steady[-1]
        lines.append(
            f"| RSS MB | {first.rss_bytes / MB:,.1f} | {last.rss_bytes / MB:,.1f} | {max(s.rss_bytes for s in steady) / MB:,.1f} |"
        )
        lines.append(
            f"| warm tier RAM MB | {first.warm_ram_bytes / MB:,.1f} | {last.warm_ram_bytes / MB:,.1f} | {max(s.warm_ram_bytes for s in steady) / MB:,.1f} |"
        )
        for label, attr in (("malloc heap in use MB", "heap_in_use_bytes"), ("malloc heap free, held MB", "heap_free_bytes")):
            values = [getattr(s, attr) / MB for s in steady]
            slope = slope_per_min([(s.at_s, v) for s, v in zip(steady, values, strict=True)])
            lines.append(f"| {label} (slope {_fmt(slope, digits=2)} MB/min) | {values[0]:,.1f} | {values[-1]:,.1f} | {max(values):,.1f} |")
        lines.append(f"| open fds | {first.open_fds} | {last.open_fds} | {max(s.open_fds for s in steady)} |")
    lines += [
        "",
        (
            f"RSS slope after warm-up: raw {_fmt(result.raw_slope_mb_per_min, digits=2)} MB/min, "
            f"net of the warm tier {_fmt(result.net_slope_mb_per_min, digits=2)} MB/min; "
            f"raw RSS max {_fmt(result.max_rss_bytes, 1 / MB, 1)} MB against a bound of {_fmt(result.rss_bound_bytes, 1 / MB, 1)} MB "
            "(resting RSS after warm-up + the warm tier's RAM budget)."
        ),
        "",
    ]
    for name, ok in result.checks.items():
        lines.append(f"- {'PASS' if ok else 'FAIL'}: {name}")
    lines += ["", f"**{'PASS' if result.passed else 'FAIL'}**"]
    return "\n".join(lines) + "\n"


def to_json(requests: list[SoakRequest], samples: list[ResourceSample], result: SoakVerdict, *, config: dict[str, Any]) -> dict[str, Any]:
    return {
        "config": config,
        "verdict": {**asdict(result), "passed": result.passed},
        "minutes": [asdict(m) for m in per_minute(requests)],
        "samples": [asdict(s) for s in samples],
        "requests": [asdict(r) for r in requests],
    }
