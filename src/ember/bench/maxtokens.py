"""The max-tokens experiment: does a longer max_tokens cost what the design says?

The design claims that raising max_tokens (50 → 100 → 200) at concurrency 10
makes "QPS fall 40–60 % while mean latency rises ~30 %". In a closed loop
Little's law (L = λW, L requests in flight, λ throughput, W mean latency)
holds L at the concurrency, so QPS ∝ 1 / latency: a 40–60 % QPS drop means a
67–150 % latency rise, and a 30 % latency rise means a 23 % QPS drop. Both
halves cannot hold at once; this module measures which one does on the
server at hand and writes that down.

It also writes ``body-<max_tokens>.json`` files and the equivalent Apache
Bench command lines, and with ``with_ab`` runs them and reads ab's numbers.
"""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from ember.bench.experiments import BenchContext
from ember.bench.report import fmt_ms, fmt_number, fmt_percent, markdown_table
from ember.bench.result import BenchResult, Group, Section, make_group
from ember.bench.workloads import story_prompt, story_requests

CLAIM_QPS_DROP = (0.40, 0.60)
# "~30 %" read as 30 ± 10 percentage points.
CLAIM_LATENCY_RISE = (0.20, 0.40)
# A reply shorter than this share of max_tokens means the model stopped early (EOS).
FULL_LENGTH_SHARE = 0.95


@dataclass(frozen=True)
class Point:
    """One max_tokens setting: throughput, mean latency and the implied requests in flight."""

    max_tokens: int
    qps: float
    mean_latency_s: float
    mean_output_tokens: float

    @property
    def in_flight(self) -> float:
        """λW: by Little's law the mean number of requests in flight."""
        return self.qps * self.mean_latency_s


def point_of(group: Group) -> Point:
    s = group.summary
    return Point(
        max_tokens=int(group.params["max_tokens"]),
        qps=s.request_throughput,
        mean_latency_s=s.e2e.mean or float("nan"),
        mean_output_tokens=s.output_tokens / s.completed if s.completed else float("nan"),
    )


def latency_rise_for_qps_drop(drop: float) -> float:
    """The latency rise Little's law implies at fixed L for a fractional QPS drop (0.4 → 0.667)."""
    return 1.0 / (1.0 - drop) - 1.0


def verdict(points: list[Point], concurrency: int) -> str:
    """A paragraph saying whether the 40–60 % / ~30 % claim holds on these points, and why."""
    if len(points) < 2:
        return "One max_tokens value only: nothing to compare."
    base, last = points[0], points[-1]
    drop = 1.0 - last.qps / base.qps
    rise = last.mean_latency_s / base.mean_latency_s - 1.0
    qps_holds = CLAIM_QPS_DROP[0] <= drop <= CLAIM_QPS_DROP[1]
    latency_holds = CLAIM_LATENCY_RISE[0] <= rise <= CLAIM_LATENCY_RISE[1]
    low, high = (latency_rise_for_qps_drop(d) for d in CLAIM_QPS_DROP)
    in_flight = ", ".join(fmt_number(p.in_flight, 2) for p in points)
    lines = [
        (
            f"From max_tokens {base.max_tokens} to {last.max_tokens}, QPS fell by **{fmt_percent(drop)}** "
            f"(claim 40–60 %: {'holds' if qps_holds else 'does not hold'}) and mean latency rose by "
            f"**{fmt_percent(rise)}** (claim ~30 %, read as 20–40 %: {'holds' if latency_holds else 'does not hold'})."
        ),
        "",
        (
            f"Little's law, L = λW, keeps L at the concurrency in a closed loop, so QPS ∝ 1 / latency: a 40–60 % QPS "
            f"drop implies a {fmt_percent(low)}–{fmt_percent(high)} latency rise, and a 30 % latency rise implies only a "
            f"{fmt_percent(1 - 1 / 1.3)} QPS drop. The two halves of the claim cannot both hold at fixed concurrency."
        ),
        "",
        (
            f"Measured λW per point: {in_flight} requests in flight (concurrency {concurrency}). From the measured QPS "
            f"drop the law predicts a latency rise of {fmt_percent(latency_rise_for_qps_drop(drop))}; measured "
            f"{fmt_percent(rise)}."
        ),
    ]
    short = [p for p in points if p.mean_output_tokens < FULL_LENGTH_SHARE * p.max_tokens]
    if short:
        names = ", ".join(f"{p.max_tokens} (mean {fmt_number(p.mean_output_tokens, 0)} tokens)" for p in short)
        lines += ["", f"Caution: replies stopped before max_tokens at {names}; run with --ignore-eos on a server that supports it."]
    return "\n".join(lines)


def points_table(points: list[Point]) -> str:
    base = points[0]
    rows = [
        [
            str(p.max_tokens),
            fmt_number(p.qps, 2),
            fmt_ms(p.mean_latency_s),
            fmt_percent(p.qps / base.qps - 1, signed=True),
            fmt_percent(p.mean_latency_s / base.mean_latency_s - 1, signed=True),
            fmt_number(p.mean_output_tokens, 1),
            fmt_number(p.in_flight, 2),
        ]
        for p in points
    ]
    headers = [
        "max_tokens",
        "QPS",
        "mean latency (ms)",
        f"QPS vs {base.max_tokens}",
        f"latency vs {base.max_tokens}",
        "output tokens (mean)",
        "λW",
    ]
    return markdown_table(headers, rows)


def ab_command(body_file: str, concurrency: int, requests: int, url: str, api_key: str | None) -> list[str]:
    """Apache Bench arguments for the same experiment (``-l``: replies differ in length, that is no error)."""
    command = ["ab", "-c", str(concurrency), "-n", str(requests), "-l", "-p", body_file, "-T", "application/json"]
    if api_key:
        command += ["-H", f"Authorization: Bearer {api_key}"]
    return [*command, url.rstrip("/") + "/chat/completions"]


_AB_QPS = re.compile(r"^Requests per second:\s+([0-9.]+)", re.MULTILINE)
_AB_LATENCY = re.compile(r"^Time per request:\s+([0-9.]+) \[ms\] \(mean\)$", re.MULTILINE)
_AB_FAILED = re.compile(r"^Non-2xx responses:\s+(\d+)", re.MULTILINE)


def parse_ab(output: str) -> dict[str, float]:
    """QPS, mean latency (s) and non-2xx count from ab's report; raises ValueError when absent."""
    qps, latency = _AB_QPS.search(output), _AB_LATENCY.search(output)
    if qps is None or latency is None:
        raise ValueError("no 'Requests per second' / 'Time per request' in ab's output")
    failed = _AB_FAILED.search(output)
    return {
        "qps": float(qps.group(1)),
        "mean_latency_s": float(latency.group(1)) / 1000.0,
        "non_2xx": float(failed.group(1)) if failed else 0.0,
    }


async def run_max_tokens(
    ctx: BenchContext, *, concurrency: int, max_tokens_list: list[int], requests_per_point: int, out_dir: Path, with_ab: bool
) -> BenchResult:
    """Closed loop at ``concurrency`` for each max_tokens; the verdict on the claim; ab equivalents."""
    ignore_eos = ctx.use_ignore_eos()
    groups = []
    for max_tokens in max_tokens_list:
        label = f"max_tokens={max_tokens}"
        make = story_requests(max_tokens, ignore_eos=ignore_eos, group=label)
        run = await ctx.run_load(label, make, concurrency=concurrency, requests=requests_per_point)
        groups.append(
            make_group(label, {"concurrency": concurrency, "max_tokens": max_tokens, "requests": requests_per_point}, run, ctx.slo)
        )
    points = [point_of(g) for g in groups]

    out_dir.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 (once, after the load: blocks nothing in flight)
    commands: list[list[str]] = []
    for max_tokens in max_tokens_list:
        # The same body for every request (ab cannot vary it), not streamed: ab does not read SSE.
        body = story_requests(max_tokens, ignore_eos=ignore_eos, stream=False)(0).body(ctx.sender.model)
        body_file = f"body-{max_tokens}.json"
        (out_dir / body_file).write_text(json.dumps(body) + "\n")
        commands.append(ab_command(body_file, concurrency, requests_per_point, ctx.sender.target.url, ctx.sender.target.api_key))
    ab_text = "Run in the result directory (ab opens a new connection per request unless given -k):\n\n```sh\n"
    ab_text += "\n".join(shlex.join(c) for c in commands) + "\n```"
    ab_results: dict[str, dict[str, float]] = {}
    if with_ab:
        ab_results, ab_note = await _run_ab(commands, out_dir)
        ab_text += "\n\n" + ab_note
    sections = [
        Section("QPS and latency vs max_tokens", points_table(points)),
        Section("Verdict", verdict(points, concurrency)),
        Section("The same with ab", ab_text),
    ]
    config = ctx.config(
        concurrency=concurrency,
        max_tokens=max_tokens_list,
        requests_per_point=requests_per_point,
        ignore_eos=ignore_eos,
        prompt=story_prompt(0)[0]["content"],
    )
    extras = {
        "points": [asdict(p) | {"in_flight": p.in_flight} for p in points],
        "ab_commands": [shlex.join(c) for c in commands],
        "ab": ab_results,
    }
    return BenchResult(
        "max-tokens", config, groups, ctx.slo, plots=["latency_cdf", "qps_latency_vs_max_tokens"], sections=sections, extras=extras
    )


async def _run_ab(commands: list[list[str]], out_dir: Path) -> tuple[dict[str, dict[str, float]], str]:
    """Run each ab command (in ``out_dir``, where the bodies are); a table of its QPS and latency."""
    if shutil.which("ab") is None:
        return {}, "`ab` is not installed (Debian/Ubuntu: `apt-get install apache2-utils`), so it was not run."
    results: dict[str, dict[str, float]] = {}
    rows = []
    for command in commands:
        body_file = command[command.index("-p") + 1]
        done = await asyncio.to_thread(subprocess.run, command, cwd=out_dir, capture_output=True, text=True, timeout=3600)
        (out_dir / f"ab-{Path(body_file).stem}.txt").write_text(done.stdout + done.stderr)
        try:
            parsed = parse_ab(done.stdout)
        except ValueError:
            rows.append([body_file, "–", "–", f"ab failed (exit {done.returncode})"])
            continue
        results[body_file] = parsed
        rows.append([body_file, fmt_number(parsed["qps"], 2), fmt_ms(parsed["mean_latency_s"]), str(int(parsed["non_2xx"]))])
    return results, markdown_table(["body", "ab QPS", "ab mean latency (ms)", "non-2xx"], rows)
