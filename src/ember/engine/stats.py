"""What the engine tells the outside about itself: fixed facts and per-step snapshots.

``EngineInfo`` is fixed once the model is loaded. ``EngineSnapshot`` is
published by the engine thread after every step (and while idle), as a new
frozen object: readers on other threads (metrics scrapes, admission, /health)
take the reference and read a consistent picture without a lock and without
touching engine state.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineCounters:
    """Monotonic counters since start, kept by the engine thread."""

    steps: int = 0
    # Tokens run through the model as prompt chunks (prefix hits excluded).
    prefill_tokens_computed: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    finished: int = 0
    aborted: int = 0
    timed_out: int = 0
    busy_seconds: float = 0.0
    # Speculative decoding: tokens guessed and verified, and how many of them the model kept.
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0


@dataclass(frozen=True)
class EngineInfo:
    """Facts about a loaded engine that never change while it runs."""

    model_name: str
    fingerprint: str
    max_model_len: int
    block_size: int
    kv_cache_bytes: int
    kv_capacity_tokens: int
    dtype: str
    quantization: str
    threads: int
    sessions_enabled: bool
    session_dir: str | None
    vocab_size: int = 0
    # Sampling defaults the model ships with (temperature, top_p ...), if any.
    generation_defaults: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state after one step (engine clock ``at``)."""

    at: float = 0.0
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    max_num_batched_tokens: int = 0
    counters: EngineCounters = field(default_factory=EngineCounters)
    prefix_query_tokens: int = 0
    prefix_hit_tokens: dict[str, int] = field(default_factory=dict)
    session_counts: dict[str, int] = field(default_factory=dict)
    session_bytes: dict[str, int] = field(default_factory=dict)
    session_events: dict[str, int] = field(default_factory=dict)
