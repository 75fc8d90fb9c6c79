"""``python -m benchmarks <experiment>``: the README's experiments, one subcommand each.

Each experiment starts what it measures (servers on free ports, or an engine in
this process) and writes its results under ``bench-results/``. The modules
import torch and start processes inside their ``main`` only, so that building
this parser stays cheap.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Experiment:
    """One ``python -m benchmarks <name>``: the module that holds it and the names of its two functions."""

    name: str
    help: str
    module: str
    add_arguments: str = "add_arguments"
    main: str = "main"

    def function(self, attribute: str) -> Callable[[argparse.Namespace], int]:
        return getattr(importlib.import_module(f"benchmarks.{self.module}"), attribute)  # type: ignore[no-any-return]


EXPERIMENTS: list[Experiment] = [
    Experiment("engine", "the engine alone, in process: decode, prefill and 16-sequence tokens/s vs references", "engine_bench"),
    Experiment(
        "linears",
        "the linear layers alone: the W8A16 kernel vs fbgemm's int8 activations, and this core's instruction-mix ceilings",
        "linears_bench",
    ),
    Experiment(
        "structured",
        "the engine alone, in process: decode tokens/s with a JSON-schema constraint vs without (1 and 16 streams)",
        "structured_bench",
    ),
    Experiment(
        "speculation",
        "starts servers: speculative decoding on vs off (prompt lookup and prediction), through HTTP and in process",
        "speculation_bench",
    ),
    Experiment("front-door", "starts a server: decode, TTFT, 16 streams, prefill and multi-turn through HTTP vs in process", "front_door"),
    Experiment(
        "kv-cache",
        "starts servers: 16 streams with short and ~1,000-token prompts, float32 vs the opt-in float16 KV cache, HTTP and in process",
        "kv_cache_bench",
    ),
    Experiment(
        "restore-stall",
        "the engine alone, in process: another stream's inter-token gaps during a warm restore from disk, now vs before",
        "restore_stall",
    ),
    Experiment(
        "tiers", "starts servers: multi-turn TTFT with hot, warm and cold session tiers", "scenarios", "tiers_arguments", "run_tiers"
    ),
    Experiment(
        "overload",
        "starts servers: open loop at 2x capacity, admission control on vs off",
        "scenarios",
        "overload_arguments",
        "run_overload",
    ),
    Experiment(
        "transports",
        "starts servers: HTTP/1.1 SSE vs HTTP/2 vs gRPC: TTFT, ITL, CPU and bytes per token",
        "transports",
        "add_transports_arguments",
        "transports_main",
    ),
    Experiment(
        "soak",
        "starts a server (or watches one): a long mixed load with cancellations; errors, p50/p99 per minute, RSS slope, fds",
        "soak",
    ),
    Experiment(
        "fronts",
        "starts servers: TTFT and tokens/s direct, through ember route and through Ray Serve (ember[ray])",
        "fronts",
        "fronts_arguments",
        "run_fronts",
    ),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description="The project's experiments (README, Performance).")
    sub = parser.add_subparsers(dest="experiment", required=True, metavar="{" + ",".join(e.name for e in EXPERIMENTS) + "}")
    for experiment in EXPERIMENTS:
        p = sub.add_parser(experiment.name, help=experiment.help, description=experiment.help)
        experiment.function(experiment.add_arguments)(p)
        p.set_defaults(run=experiment.function(experiment.main))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args) or 0)
