"""``ember serve``: every option with its default, read from ``ember.config``."""

from __future__ import annotations

import argparse
import os
from typing import get_args

from ember.config import PROFILE_PRESETS, Dtype, EngineConfig, KVCacheDtype, ServerConfig, SessionConfig, WarmFormat

_E, _S, _SS = EngineConfig(), ServerConfig(), SessionConfig()
MIB = 1024 * 1024


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model (default: the embedded SmolLM2-135M-Instruct) over an OpenAI-compatible API.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    m = p.add_argument_group("model and engine")
    m.add_argument("--model", default=None, help="GGUF file or Hugging Face directory; omit for the embedded model")
    m.add_argument("--served-model-name", default=None, help="model id reported by the API (default: the model's name)")
    m.add_argument("--dtype", default=_E.dtype, choices=get_args(Dtype), help="activation and KV-cache dtype")
    m.add_argument(
        "--quantization", default=_E.quantization, choices=["none", "int8", "w8a8"], help="weight quantization (see README, Numerics)"
    )
    m.add_argument("--device", default=_E.device, help="torch device: cpu, cuda, cuda:1 ...")
    m.add_argument("--threads", type=int, default=_E.threads, help="torch intra-op threads (0: torch's default)")
    m.add_argument("--kv-cache-mb", type=int, default=_E.kv_cache_bytes // MIB, help="memory budget of the KV block pool, MiB")
    m.add_argument(
        "--kv-cache-dtype",
        default=_E.kv_cache_dtype,
        choices=get_args(KVCacheDtype),
        help="KV cache element type; auto: --dtype. float16 holds twice the tokens and reads half the bytes, "
        "but rounds keys and values: answers may change (README, Numerics)",
    )
    m.add_argument("--block-size", type=int, default=_E.block_size, help="tokens per KV block")
    m.add_argument(
        "--max-num-batched-tokens", type=int, default=_E.max_num_batched_tokens, help="per-step token budget (prefill chunk size)"
    )
    m.add_argument("--max-num-seqs", type=int, default=_E.max_num_seqs, help="most sequences in one step")
    m.add_argument("--max-model-len", type=int, default=_E.max_model_len, help="context limit (0: the model's own)")
    m.add_argument("--no-prefix-caching", action="store_true", help="disable KV prefix reuse")
    m.add_argument(
        "--no-batch-invariant",
        action="store_true",
        help="the previous per-shape kernels: faster on AVX-512, but a request's tokens may change with what shares its batch",
    )

    m.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=_E.num_speculative_tokens,
        help="most tokens drafted per step from the request's own text or its prediction, verified exactly (0: off)",
    )

    s = p.add_argument_group("server")
    s.add_argument("--host", default=_S.host)
    s.add_argument("--port", type=int, default=_S.port)
    s.add_argument(
        "--api-key", default=os.environ.get("EMBER_API_KEY"), help="require 'Authorization: Bearer KEY' on /v1 (env EMBER_API_KEY)"
    )
    presets = "; ".join(
        f"{name}: max_tokens {p.max_tokens}, temperature {p.temperature}, top_p {p.top_p}" for name, p in PROFILE_PRESETS.items()
    )
    s.add_argument(
        "--profile", default=_S.profile, choices=sorted(PROFILE_PRESETS), help=f"defaults for fields a request leaves out ({presets})"
    )
    s.add_argument(
        "--default-temperature",
        type=float,
        default=None,
        help="temperature for requests that set none (overrides the model's and the profile's)",
    )
    s.add_argument(
        "--default-top-p", type=float, default=None, help="top_p for requests that set none (overrides the model's and the profile's)"
    )
    s.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="Jinja chat template to use instead of the model's (a template that reads `tools` renders tool definitions itself)",
    )
    s.add_argument("--max-tokens-limit", type=int, default=_S.max_tokens_limit, help="cap on any request's max_tokens")
    s.add_argument(
        "--request-timeout",
        type=float,
        default=_S.request_timeout_s,
        help="default per-request deadline, seconds (body 'timeout' or X-Request-Timeout override)",
    )
    s.add_argument("--max-body-bytes", type=int, default=_S.max_body_bytes, help="larger request bodies get 413")
    s.add_argument("--max-messages", type=int, default=_S.max_messages, help="most messages in one chat request")
    s.add_argument("--drain-timeout", type=float, default=_S.drain_timeout_s, help="seconds in-flight requests get to finish after SIGTERM")
    s.add_argument("--warmup-requests", type=int, default=_S.warmup_requests, help="generations run before /ready turns 200")
    s.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate")
    s.add_argument("--ssl-keyfile", default=None, help="private key for --ssl-certfile")
    s.add_argument(
        "--http2",
        action="store_true",
        help="serve HTTP/2 next to HTTP/1.1 (h2c prior knowledge; ALPN with --ssl-certfile) with granian instead of uvicorn",
    )
    s.add_argument(
        "--grpc-port",
        type=int,
        default=_S.grpc_port,
        help="also serve the gRPC API (ember.v1.Generation, health, reflection) on this port; TLS with --ssl-certfile",
    )
    s.add_argument(
        "--trace-memory",
        action="store_true",
        help="log, per request, the peak of Python allocations (tracemalloc) of the whole process while it was in flight (process_peak_python_bytes)",
    )
    s.add_argument("--log-level", default=_S.log_level, choices=["debug", "info", "warning", "error"])
    a = p.add_argument_group("admission control and overload objectives (degradation)")
    a.add_argument("--max-running", type=int, default=_S.max_running, help="requests inside the engine at once; the rest wait")
    a.add_argument("--max-queue", type=int, default=_S.max_queue, help="requests that may wait; beyond: 429 + Retry-After")
    a.add_argument("--max-queued-tokens", type=int, default=_S.max_queued_tokens, help="prompt tokens that may wait; beyond: 429")
    a.add_argument("--per-key-concurrency", type=int, default=_S.per_key_concurrency, help="requests in flight per API key (0: unlimited)")
    a.add_argument(
        "--slo-queue-p99",
        type=float,
        default=_S.slo_queue_p99_s,
        help="p99 objective for the wait from arrival to first scheduling (admission + engine queue), seconds",
    )
    a.add_argument(
        "--slo-itl-p99", type=float, default=_S.slo_itl_p99_s, help="p99 objective for the gap between a stream's tokens, seconds"
    )
    a.add_argument(
        "--slo-ttft-p99",
        type=float,
        default=_S.slo_ttft_p99_s,
        help="optional p99 objective for time to first token (from arrival), seconds",
    )
    a.add_argument(
        "--slo-eval-window", type=float, default=_S.slo_eval_window_s, help="trailing seconds the p99s and the standing-queue check look at"
    )
    a.add_argument(
        "--slo-window",
        type=float,
        default=_S.slo_window_s,
        help="seconds an overload signal must hold (or stay absent) to degrade (or recover)",
    )
    a.add_argument(
        "--slo-min-samples", type=int, default=_S.slo_min_samples, help="requests needed in the evaluation window before p99 counts"
    )

    t = p.add_argument_group("conversation sessions (hot / warm / cold KV tiers)")
    t.add_argument("--hot-ttl", type=float, default=_SS.hot_ttl_s, help="seconds a conversation's KV stays protected in the pool")
    t.add_argument("--warm-ttl", type=float, default=_SS.warm_ttl_s, help="seconds demoted KV is kept in RAM or on disk")
    t.add_argument("--warm-memory-mb", type=int, default=_SS.warm_memory_bytes // MIB, help="RAM budget of the warm tier, MiB")
    t.add_argument("--session-dir", default=_SS.session_dir, help="directory where warm state spills and survives restarts")
    t.add_argument("--warm-disk-mb", type=int, default=_SS.warm_disk_bytes // MIB, help="disk budget of the warm tier, MiB")
    t.add_argument("--warm-format", default=_SS.warm_format, choices=get_args(WarmFormat), help="how warm KV is stored")
    t.add_argument(
        "--write-behind",
        type=float,
        default=_SS.write_behind_s,
        help="seconds a hot conversation is idle before a copy goes to --session-dir (survives a crash); negative: never",
    )
    t.add_argument("--no-sessions", action="store_true", help="disable session tiers (prefix caching still works)")
    from ember.ray.cli import add_arguments as add_ray_arguments

    add_ray_arguments(p)
    p.set_defaults(func=run_serve)


def configs_from_args(args: argparse.Namespace) -> tuple[ServerConfig, EngineConfig, SessionConfig]:
    engine = EngineConfig(
        dtype=args.dtype,
        quantization=args.quantization,
        device=args.device,
        threads=args.threads,
        block_size=args.block_size,
        kv_cache_bytes=args.kv_cache_mb * MIB,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        batch_invariant=not args.no_batch_invariant,
        num_speculative_tokens=args.num_speculative_tokens,
    )
    server = ServerConfig(
        host=args.host,
        port=args.port,
        model=args.model,
        served_model_name=args.served_model_name,
        api_key=args.api_key or None,
        profile=args.profile,
        default_temperature=args.default_temperature,
        default_top_p=args.default_top_p,
        chat_template=args.chat_template,
        max_tokens_limit=args.max_tokens_limit,
        request_timeout_s=args.request_timeout,
        max_body_bytes=args.max_body_bytes,
        max_messages=args.max_messages,
        drain_timeout_s=args.drain_timeout,
        warmup_requests=args.warmup_requests,
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
        http2=args.http2,
        grpc_port=args.grpc_port,
        trace_memory=args.trace_memory,
        log_level=args.log_level,
        max_running=args.max_running,
        max_queue=args.max_queue,
        max_queued_tokens=args.max_queued_tokens,
        per_key_concurrency=args.per_key_concurrency,
        slo_queue_p99_s=args.slo_queue_p99,
        slo_itl_p99_s=args.slo_itl_p99,
        slo_ttft_p99_s=args.slo_ttft_p99,
        slo_eval_window_s=args.slo_eval_window,
        slo_window_s=args.slo_window,
        slo_min_samples=args.slo_min_samples,
    )
    sessions = SessionConfig(
        hot_ttl_s=args.hot_ttl,
        warm_ttl_s=args.warm_ttl,
        warm_memory_bytes=args.warm_memory_mb * MIB,
        session_dir=args.session_dir,
        warm_disk_bytes=args.warm_disk_mb * MIB,
        warm_format=args.warm_format,
        write_behind_s=args.write_behind,
        enabled=not args.no_sessions,
    )
    return server, engine, sessions


def check_slo_args(args: argparse.Namespace) -> None:
    """Refuse objectives the degradation controller cannot run with, before the model loads."""
    if min(args.slo_queue_p99, args.slo_itl_p99) <= 0 or (args.slo_ttft_p99 is not None and args.slo_ttft_p99 <= 0):
        raise SystemExit("--slo-queue-p99, --slo-itl-p99 and --slo-ttft-p99 must be positive")
    if not 0 < args.slo_eval_window < args.slo_window:
        raise SystemExit("--slo-eval-window must be positive and shorter than --slo-window")
    if args.slo_min_samples < 1:
        raise SystemExit("--slo-min-samples must be at least 1")


def run_serve(args: argparse.Namespace) -> int:
    check_slo_args(args)
    if args.ray:
        from ember.ray.cli import ray_config_from_args
        from ember.ray.config import RayConfigError

        try:
            ray_config = ray_config_from_args(args)
        except RayConfigError as exc:
            raise SystemExit(f"ember serve: {exc}") from None
        try:
            from ember.ray.app import serve_on_ray
        except ModuleNotFoundError as exc:
            if exc.name != "ray":
                raise
            raise SystemExit("ember serve --ray needs Ray Serve: pip install 'ember[ray]'") from None
        return serve_on_ray(*configs_from_args(args), ray_config)
    from ember.server.serve import serve

    if args.default_temperature is not None and not 0.0 <= args.default_temperature <= 2.0:
        raise SystemExit("--default-temperature must be between 0 and 2")
    if args.default_top_p is not None and not 0.0 < args.default_top_p <= 1.0:
        raise SystemExit("--default-top-p must be in (0, 1]")
    if args.chat_template is not None:
        from ember.engine.api import check_chat_template_file

        check_chat_template_file(args.chat_template)  # fail now, not after the model loaded
    return serve(*configs_from_args(args))
