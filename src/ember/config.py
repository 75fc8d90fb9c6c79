"""Configuration: small frozen dataclasses, and the only home of defaults.

The CLI reads its help texts and defaults from here, so a default changes in one
place. Every field documents its unit in its name (``_s`` seconds, ``_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Dtype = Literal["float32", "bfloat16"]
Quantization = Literal["none", "int8", "int4", "w8a8"]
KVCacheDtype = Literal["auto", "float16"]
# How demoted (warm) KV is stored: engine/warm_storage.py.
WarmFormat = Literal["int8", "bf16", "exact"]


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama, Mistral, Qwen2, SmolLM)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    # Llama 3 style frequency scaling: (factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings) or None for plain RoPE.
    rope_llama3_scaling: tuple[float, float, float, int] | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model: numerics, memory and batching.

    ``dtype`` is the activation and KV-cache dtype. ``quantization="int8"`` stores
    linear weights as int8 with one scale per output channel (the embedding and
    norms stay in ``dtype``). The default pair was chosen by measurement on a
    2-core AVX-512 CPU; see README "Numerics".
    """

    dtype: Dtype = "float32"
    quantization: Quantization = "int8"
    device: str = "cpu"
    # torch intra-op threads; 0 keeps torch's own choice.
    threads: int = 0
    # Tokens per KV block. Prefix reuse works at block granularity.
    block_size: int = 16
    # Memory budget of the preallocated KV block pool.
    kv_cache_bytes: int = 512 * 1024 * 1024
    # The KV cache's element type. "auto" is ``dtype``. "float16" halves the
    # cache: twice the tokens in kv_cache_bytes and half the bytes attention
    # reads per step, but every stored key and value is rounded to float16, so
    # answers can differ from float32's: opt-in, its agreement printed by
    # tests/engine/test_kv_cache_dtype.py (README, "Numerics").
    kv_cache_dtype: KVCacheDtype = "auto"
    # Per-step token budget: decodes first, then prefill chunks fill the rest.
    # A long prompt therefore delays running streams by at most one such step.
    max_num_batched_tokens: int = 512
    # Upper bound on sequences in one step (running decodes + prefills).
    max_num_seqs: int = 64
    # Longest prompt + completion accepted; 0 means the model's own context.
    max_model_len: int = 0
    # Keep finished requests' blocks as reusable prefix cache.
    enable_prefix_caching: bool = True
    # Same request, same tokens, whatever else shares the step, however the
    # prompt was chunked or cached (README, "Same seed, same answer"). Needs the
    # compiled CPU kernels; False takes the previous, per-shape fastest kernels.
    batch_invariant: bool = True
    # Speculative decoding (engine/speculation.py): at most this many tokens
    # guessed per step from the request's own text or its ``prediction`` and
    # verified in the same forward pass; 0 turns it off. Exact (never changes a
    # token), so it needs the batch-invariant kernels and is off without them.
    num_speculative_tokens: int = 8
    # The n-gram lengths a prompt-lookup draft is matched on, longest first.
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    seed: int = 0


@dataclass(frozen=True)
class SessionConfig:
    """Per-conversation KV tiers: hot (in the pool), warm (RAM, then disk), cold."""

    hot_ttl_s: float = 300.0
    warm_ttl_s: float = 3600.0
    warm_memory_bytes: int = 1024 * 1024 * 1024
    # Where warm state spills beyond the RAM budget; None keeps warm state in RAM only.
    session_dir: str | None = None
    warm_disk_bytes: int = 8 * 1024 * 1024 * 1024
    # How warm KV is stored: "int8" (~3.8x smaller), "bf16" (2x), "exact".
    warm_format: WarmFormat = "int8"
    # With a session_dir: seconds a hot conversation must be idle before a copy of
    # its KV is written there (it stays hot), so that a replica killed without
    # warning leaves it warm rather than cold. Negative: never.
    write_behind_s: float = 1.0
    enabled: bool = True


@dataclass(frozen=True)
class ServerConfig:
    """HTTP server options (``ember serve``)."""

    host: str = "127.0.0.1"
    port: int = 8000
    model: str | None = None
    served_model_name: str | None = None
    api_key: str | None = None
    profile: Literal["support", "creative"] = "support"
    # Override the profile's and the model's sampling defaults (None: keep them).
    default_temperature: float | None = None
    default_top_p: float | None = None
    # A Jinja chat template file used instead of the model's own.
    chat_template: str | None = None
    max_tokens_limit: int = 1024
    request_timeout_s: float = 10.0
    max_body_bytes: int = 1024 * 1024
    max_messages: int = 2048
    drain_timeout_s: float = 30.0
    warmup_requests: int = 3
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    # Serve HTTP/2 next to HTTP/1.1 on `port` (h2c with prior knowledge; ALPN on TLS).
    http2: bool = False
    # Also serve the gRPC API (ember.v1.Generation) on this port, in the same process.
    grpc_port: int | None = None
    # Seconds in-flight gRPC calls get when the gRPC server stops (after the drain).
    grpc_grace_s: float = 5.0
    trace_memory: bool = False
    log_level: str = "info"
    # Admission control (see server/admission.py).
    max_queue: int = 64
    max_queued_tokens: int = 65_536
    max_running: int = 32
    per_key_concurrency: int = 0
    # Degradation controller (see server/degrade.py): it acts on overload
    # signals only (queue wait, inter-token latency, a standing queue, and
    # optionally TTFT), never on end-to-end latency, which a long answer on an
    # idle server is entitled to.
    slo_queue_p99_s: float = 1.0
    slo_itl_p99_s: float = 0.25
    slo_ttft_p99_s: float | None = None
    # Seconds a condition must hold (or be absent) before degrading (or recovering).
    slo_window_s: float = 120.0
    # Trailing window the p99s and the standing-queue check look at; shorter than slo_window_s.
    slo_eval_window_s: float = 60.0
    slo_min_samples: int = 20


@dataclass(frozen=True)
class GenerationPreset:
    """What a request gets for the fields it leaves out, by ``--profile``.

    Support answers are short and near-deterministic, creative ones longer and
    warmer. temperature 0.2 / top_p 0.9 is what SmolLM2's model card samples
    its instruct models with. A model's own recommendation
    (generation_config.json) takes precedence over the preset's sampling
    values, and ``--default-temperature`` / ``--default-top-p`` over both.
    """

    max_tokens: int
    temperature: float
    top_p: float


PROFILE_PRESETS: dict[str, GenerationPreset] = {
    "support": GenerationPreset(max_tokens=80, temperature=0.2, top_p=0.9),
    "creative": GenerationPreset(max_tokens=300, temperature=0.8, top_p=0.95),
}
# max_tokens applied when a request does not set one, by --profile.
MAX_TOKENS_PRESETS: dict[str, int] = {name: preset.max_tokens for name, preset in PROFILE_PRESETS.items()}
