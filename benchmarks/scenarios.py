"""Scenario benchmarks that start their own servers: session tiers and overload.

Each scenario launches ``ember serve`` with the configurations it compares,
drives them with the ordinary bench workloads (``ember bench multiturn``,
``load``...) as subprocesses, and prints one comparison table. Servers run one
at a time so that they never compete for the two cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from benchmarks.servers import ServerProcess


def _bench(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "ember.cli", "bench", *args, "--quiet"], check=True)


def _summary(out: Path) -> dict[str, Any]:
    return json.loads((out / "summary.json").read_text())


def _out_root(args: argparse.Namespace, name: str) -> Path:
    root = Path(args.out or f"bench-results/{name}-{datetime.now():%Y%m%d-%H%M%S}")
    root.mkdir(parents=True, exist_ok=True)
    return root


def _table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Session tiers: hot vs warm vs cold TTFT by turn
# ---------------------------------------------------------------------------


def tier_configs(root: Path) -> dict[str, tuple[str, list[str]]]:
    """Server flags per column: (column title, flags)."""
    return {
        "hot": ("hot", []),
        # Every turn copied to disk as soon as it ends, while the next turns run: the
        # write-behind's worst case (by default it waits for 1 s of idleness).
        "hot_written": ("hot, written behind (--write-behind 0)", ["--session-dir", str(root / "session-dir"), "--write-behind", "0"]),
        "warm": ("warm (--hot-ttl 0)", ["--hot-ttl", "0"]),  # demoted right after every turn: each next turn restores from RAM
        "cold": ("cold (no sessions, no prefix cache)", ["--no-sessions", "--no-prefix-caching"]),
    }


def tiers_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)


def run_tiers(args: argparse.Namespace) -> int:
    root = _out_root(args, "tiers")
    by_tier: dict[str, dict[str, Any]] = {}
    configs = tier_configs(root)
    for tier, (_, extra) in configs.items():
        with ServerProcess(*extra, "--request-timeout", "300", "--warmup-requests", "2", threads=args.threads) as server:
            out = root / tier
            _bench(
                "multiturn",
                "--url",
                server.url,
                "--conversations",
                str(args.conversations),
                "--turns",
                str(args.turns),
                "--system-tokens",
                str(args.system_tokens),
                "--max-tokens",
                str(args.max_tokens),
                "--ignore-eos",
                "--timeout",
                "600",
                "--out",
                str(out),
            )
            by_tier[tier] = _summary(out)["extras"]["ttft_by_turn"]
    rows = []
    for turn in sorted(by_tier["hot"], key=int):
        row = [turn]
        for tier in configs:
            stats = by_tier[tier].get(turn, {})
            row.append(f"{1000 * stats.get('p50', float('nan')):.0f} / {1000 * stats.get('p99', float('nan')):.0f}")
        rows.append(row)
    last = str(args.turns)
    hot, written, warm, cold = (by_tier[t][last]["p50"] for t in ("hot", "hot_written", "warm", "cold"))
    report = "\n".join(
        [
            (
                f"TTFT p50 / p99 (ms) by turn, {args.conversations} conversations x {args.turns} turns, "
                f"~{args.system_tokens}-token system prompt, max_tokens {args.max_tokens}"
            ),
            "",
            _table(["turn", *(title for title, _ in configs.values())], rows),
            "",
            f"turn {last}: hot p50 {1000 * hot:.0f} ms (target <= 60), warm/hot {warm / hot:.2f}x (target <= 2), cold/hot {cold / hot:.1f}x (target >= 10)",
            f"write-behind of every turn at once (its worst case): hot p50 {1000 * written:.0f} ms, {written / hot:.2f}x hot",
        ]
    )
    (root / "tiers.md").write_text(report + "\n")
    print(report)
    return 0


# ---------------------------------------------------------------------------
# Overload: admission control on vs off, open loop at 2x capacity
# ---------------------------------------------------------------------------

ADMISSION_OFF = ["--max-running", "100000", "--max-queue", "100000", "--max-queued-tokens", "100000000"]


def overload_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of open-loop load per configuration")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--factor", type=float, default=2.0, help="offered load as a multiple of measured capacity")
    parser.add_argument("--max-running", type=int, default=8, help="admission: requests in the engine at once")
    parser.add_argument("--max-queue", type=int, default=4, help="admission: requests waiting")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)


def run_overload(args: argparse.Namespace) -> int:
    root = _out_root(args, "overload")
    common = ["--request-timeout", "600", "--warmup-requests", "2"]
    with ServerProcess(*common, *ADMISSION_OFF, threads=args.threads) as server:
        out = root / "capacity"
        _bench(
            "load",
            "--url",
            server.url,
            "--concurrency",
            "8",
            "--requests",
            "48",
            "--max-tokens",
            str(args.max_tokens),
            "--ignore-eos",
            "--out",
            str(out),
        )
        capacity = _summary(out)["groups"][0]["summary"]["request_throughput"]
    rate = args.factor * capacity
    results: dict[str, dict[str, Any]] = {}
    configs = {"admission on": ["--max-running", str(args.max_running), "--max-queue", str(args.max_queue)], "admission off": ADMISSION_OFF}
    for name, extra in configs.items():
        with ServerProcess(*common, *extra, threads=args.threads) as server:
            out = root / name.replace(" ", "-")
            _bench(
                "load",
                "--url",
                server.url,
                "--rate",
                f"{rate:.3f}",
                "--duration",
                str(args.duration),
                "--requests",
                "0",
                "--max-tokens",
                str(args.max_tokens),
                "--ignore-eos",
                "--timeout",
                "600",
                "--out",
                str(out),
            )
            results[name] = {
                "summary": _summary(out)["groups"][0]["summary"],
                "requests": json.loads((out / "requests.json").read_text()),
                "server_429_ms": _median_ms([e["total_s"] for e in server.access_log(status=429)]),
            }
    rows = []
    for name, r in results.items():
        s = r["summary"]
        rejected_records = [x for x in r["requests"] if x.get("status") == 429]
        reject_ms = statistics.median([1000 * (x["end_s"] - x["start_s"]) for x in rejected_records]) if rejected_records else float("nan")
        ttft_p99, e2e_p99 = s["ttft"].get("p99"), s["e2e"].get("p99")
        rows.append(
            [
                name,
                str(s["completed"]),
                str(len(rejected_records)),
                "-" if ttft_p99 is None else f"{1000 * ttft_p99:.0f}",
                "-" if e2e_p99 is None else f"{e2e_p99:.2f}",
                f"{reject_ms:.1f}",
                f"{r['server_429_ms']:.2f}",
            ]
        )
    report = "\n".join(
        [
            (
                f"Open loop (Poisson) at {rate:.2f} req/s = {args.factor}x the measured capacity ({capacity:.2f} req/s), "
                f"{args.duration:.0f} s, max_tokens {args.max_tokens}"
            ),
            "",
            _table(
                [
                    "configuration",
                    "completed",
                    "429s",
                    "admitted p99 TTFT (ms)",
                    "admitted p99 E2E (s)",
                    "429 latency p50 (ms, client)",
                    "429 server time p50 (ms, access log)",
                ],
                rows,
            ),
        ]
    )
    (root / "overload.md").write_text(report + "\n")
    print(report)
    return 0


def _median_ms(seconds: list[float]) -> float:
    return 1000 * statistics.median(seconds) if seconds else float("nan")
