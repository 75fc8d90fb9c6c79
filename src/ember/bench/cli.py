"""``ember bench <workload>``: benchmark any OpenAI-compatible server, Ember or not.

Sub-subcommands come from ``SUBCOMMANDS``; adding one is one line there. An
HTTP workload is ``workload(name, help, add_arguments, run)`` where ``run`` is
an ``async def run(ctx, args) -> BenchResult``: the common options (``--url``,
``--slo`` ...) are added, the sender is opened, ``run`` runs and
``requests.json``, ``summary.json``, ``summary.md`` and the plots are written.
A command that sends no load (``compare``) is a plain
``Subcommand(..., main, http=False)``. The project's own experiments, which
start their own servers or engines (session tiers, overload, transports ...),
are not here: they live in the repository's ``benchmarks/`` (``python -m
benchmarks``) and reuse ``write_outputs`` for the same files.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from ember.bench.compare import write_comparison
from ember.bench.experiments import (
    BenchContext,
    run_load_test,
    run_multiturn,
    run_prefill,
    run_single,
    run_stream_vs_full,
    run_sweep,
)
from ember.bench.maxtokens import run_max_tokens
from ember.bench.metrics import SLO, parse_slo
from ember.bench.plotting import PLOTS_EXTRA, matplotlib_installed, resolve_plots, skipped_plots_note
from ember.bench.progress import BenchProgress
from ember.bench.record import Clock
from ember.bench.report import render_markdown, write_report
from ember.bench.result import BenchResult, save_result
from ember.bench.router_overhead import run_router_overhead
from ember.bench.sender import BenchError, Sender, Target, make_sender
from ember.client.defaults import DEFAULT_BASE_URL, api_key_from_env
from ember.client.transport import TRANSPORTS

RESULTS_ROOT = Path("bench-results")


@dataclass(frozen=True)
class Subcommand:
    """One ``ember bench <name>``: its options and what runs it (returns the exit code)."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    main: Callable[[argparse.Namespace], int]
    # Add the common server options (--url, --model, --slo ...).
    http: bool = True


# ---------------------------------------------------------------------------
# Argument types and option groups
# ---------------------------------------------------------------------------


def int_list(text: str) -> list[int]:
    """``"1,4,16"`` → ``[1, 4, 16]`` (each >= 1)."""
    try:
        values = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def slo_arg(text: str) -> SLO:
    try:
        return parse_slo(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def header_arg(text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected 'Name: value', got {text!r}")
    return name.strip(), value.strip()


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """Options every HTTP workload shares."""
    g = parser.add_argument_group("server and output")
    g.add_argument("--url", default=DEFAULT_BASE_URL, help="OpenAI-compatible base URL, up to /v1 (http or https) (default %(default)s)")
    g.add_argument("--model", default=None, help="model id (default: the first one GET /models lists)")
    g.add_argument("--api-key", default=api_key_from_env(), help="Bearer token (default: $EMBER_API_KEY, then $OPENAI_API_KEY)")
    g.add_argument(
        "--header",
        action="append",
        type=header_arg,
        default=[],
        metavar="'NAME: VALUE'",
        help="extra request header, repeatable (e.g. 'X-Request-Timeout: 60')",
    )
    g.add_argument("--out", type=Path, default=None, help=f"result directory (default {RESULTS_ROOT}/<workload>-<timestamp>)")
    g.add_argument("--seed", type=int, default=0, help="seed of prompts and Poisson arrivals (default %(default)s)")
    g.add_argument("--slo", type=slo_arg, default="", help="goodput objectives in seconds, e.g. ttft=0.5,tpot=0.05,e2e=5")
    g.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="send ignore_eos (Ember, vLLM) so replies run to max_tokens (default: on when the server is "
        "Ember, except for multiturn, whose replies end naturally)",
    )
    g.add_argument(
        "--new-connection-per-request",
        action="store_true",
        help="open a new connection (TCP, and TLS on https) for every request, to see what handshakes cost",
    )
    g.add_argument("--http2", action="store_true", help="speak HTTP/2 (ALPN on https, prior knowledge on http); same as --transport http2")
    g.add_argument(
        "--transport",
        choices=TRANSPORTS,
        default="http1",
        help="http1, http2 (ALPN on https, prior knowledge on http) or grpc (Ember's ember.v1 API; --url grpc://host:port "
        "or grpcs://) (default %(default)s)",
    )
    g.add_argument("--insecure", action="store_true", help="accept a self-signed certificate on https")
    g.add_argument("--cacert", default=None, metavar="PEM", help="trust this CA or self-signed certificate (https and grpcs)")
    g.add_argument("--timeout", type=float, default=600.0, help="client time limit per request phase, seconds (default %(default)s)")
    g.add_argument("--warmup", type=int, default=1, help="unrecorded warm-up requests before measuring (default %(default)s)")
    g.add_argument("--quiet", action="store_true", help="no progress bar and no summary on stdout")
    add_plots_argument(g)


def add_plots_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--plots`` / ``--no-plots`` (see ``plotting.py``)."""
    parser.add_argument(
        "--plots",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"draw PNG plots; they need matplotlib ({PLOTS_EXTRA}) (default: when matplotlib is installed)",
    )


def plots_wanted(prog: str, asked: bool | None, *, quiet: bool = False) -> bool:
    """Whether ``prog`` draws plots; prints why not when only matplotlib is missing; ``BenchError`` if asked and missing."""
    installed = matplotlib_installed()
    wanted = resolve_plots(asked, installed)
    note = skipped_plots_note(asked, installed)
    if note is not None and not quiet:
        print(f"{prog}: {note}", file=sys.stderr)
    return wanted


def add_load_shape(parser: argparse.ArgumentParser, *, requests: int) -> None:
    g = parser.add_argument_group("load shape")
    g.add_argument("--concurrency", type=positive_int, default=1, help="closed loop: requests kept in flight (default %(default)s)")
    g.add_argument("--rate", type=float, default=None, help="open loop instead: Poisson arrivals per second")
    g.add_argument(
        "--requests", type=int, default=requests, help="stop after this many requests, 0 for --duration only (default %(default)s)"
    )
    g.add_argument("--duration", type=float, default=None, help="stop starting requests after this many seconds")


def _bounds(args: argparse.Namespace) -> tuple[int | None, float | None]:
    requests = args.requests or None
    if requests is None and args.duration is None:
        raise BenchError("give --requests, --duration or both")
    return requests, args.duration


# ---------------------------------------------------------------------------
# The workloads
# ---------------------------------------------------------------------------


def _single_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=positive_int, default=128, help="max_tokens of every request (default %(default)s)")
    p.add_argument("--requests", type=int, default=5, help="requests, one after the other (default %(default)s)")
    p.add_argument("--duration", type=float, default=None, help="stop starting requests after this many seconds")


async def _single(ctx: BenchContext, args: argparse.Namespace) -> BenchResult:
    requests, duration_s = _bounds(args)
    return await run_single(ctx, max_tokens=args.max_tokens, requests=requests, duration_s=duration_s)


def _prefill_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prompt-tokens",
        type=positive_int,
        default=1000,
        help="prompt length in filler words, about one token each; usage reports the exact count (default %(default)s)",
    )
    add_load_shape(p, requests=5)


async def _prefill(ctx: BenchContext, args: argparse.Namespace) -> BenchResult:
    requests, duration_s = _bounds(args)
    return await run_prefill(
        ctx, prompt_words=args.prompt_tokens, concurrency=args.concurrency, rate=args.rate, requests=requests, duration_s=duration_s
    )


def _load_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=positive_int, default=128, help="max_tokens of every request (default %(default)s)")
    add_load_shape(p, requests=20)


async def _load(ctx: BenchContext, args: argparse.Namespace) -> BenchResult:
    requests, duration_s = _bounds(args)
    return await run_load_test(
        ctx, max_tokens=args.max_tokens, concurrency=args.concurrency, rate=args.rate, requests=requests, duration_s=duration_s
    )


def _sweep_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", type=int_list, default=[1, 4, 16], help="comma-separated concurrencies (default 1,4,16)")
    p.add_argument("--max-tokens", type=int_list, default=[32, 128], help="comma-separated max_tokens values (default 32,128)")
    p.add_argument("--requests-per-point", type=positive_int, default=None, help="requests per grid point (default 4 × concurrency)")
    p.add_argument("--duration-per-point", type=float, default=None, help="seconds per grid point")


async def _sweep(ctx: BenchContext, args: argparse.Namespace) -> BenchResult:
    return await run_sweep(
        ctx,
        concurrencies=args.concurrency,
        max_tokens_list=args.max_tokens,
        requests_per_point=args.requests_per_point,
        duration_per_point_s=args.duration_per_point,
    )


def _multiturn_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--conversations", type=positive_int, default=8, help="conversations run concurrently (default %(default)s)")
    p.add_argument("--turns", type=positive_int, default=8, help="turns per conversation (default %(default)s)")
    p.add_argument(
        "--system-tokens", type=int, default=300, help="system prompt length in filler words, about one token each (default %(default)s)"
    )
    p.add_argument("--max-tokens", type=positive_int, default=64, help="max_tokens of every turn (default %(default)s)")
    p.add_argument("--think-time", type=float, default=0.0, help="seconds between a reply and the next user message (default %(default)s)")


async def _multiturn(ctx: BenchContext, args: argparse.Namespace) -> BenchResult:
    return await run_multiturn(
        ctx,
        conversations=args.conversations,
        turns=args.turns,
        system_words=args.system_tokens,
        max_tokens=args.max_tokens,
        think_time_s=args.think_time,
    )


def _stream_vs_full_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pairs", type=positive_int, default=3, help="prompts, each sent streamed and not streamed (default %(default)s)")
    p.add_argument("--max-tokens", type=positive_int, default=200, help="max_tokens of every request (default %(default)s)")


async def _stream_vs_full(ctx: BenchContext, args: argparse.Namespace) -> BenchResult:
    return await run_stream_vs_full(ctx, pairs=args.pairs, max_tokens=args.max_tokens)


def _max_tokens_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", type=positive_int, default=10, help="requests kept in flight (default %(default)s)")
    p.add_argument(
        "--max-tokens", type=int_list, default=[50, 100, 200], help="comma-separated; the first is the baseline (default 50,100,200)"
    )
    p.add_argument("--requests-per-point", type=positive_int, default=100, help="requests per max_tokens value (default %(default)s)")
    p.add_argument("--with-ab", action="store_true", help="also run the equivalent Apache Bench commands (needs ab)")


async def _max_tokens(ctx: BenchContext, args: argparse.Namespace) -> BenchResult:
    return await run_max_tokens(
        ctx,
        concurrency=args.concurrency,
        max_tokens_list=args.max_tokens,
        requests_per_point=args.requests_per_point,
        out_dir=args.out,
        with_ab=args.with_ab,
    )


def _router_overhead_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--direct-url", required=True, help="a replica behind the router (--url), up to /v1")
    p.add_argument("--pairs", type=positive_int, default=30, help="single streams to each, interleaved (default %(default)s)")
    p.add_argument("--max-tokens", type=positive_int, default=16, help="max_tokens of every request (default %(default)s)")
    p.add_argument("--concurrency", type=positive_int, default=16, help="streams in flight in the throughput rounds (default %(default)s)")
    p.add_argument("--requests", type=positive_int, default=32, help="requests per throughput round and path (default %(default)s)")
    p.add_argument("--rounds", type=positive_int, default=2, help="throughput rounds per path, alternating (default %(default)s)")


async def _router_overhead(ctx: BenchContext, args: argparse.Namespace) -> BenchResult:
    # The replica gets exactly the client the router gets: same model, headers and options.
    target = dataclasses.replace(ctx.sender.target, url=args.direct_url, model=ctx.sender.model)
    async with Sender(target, ctx.clock) as direct:
        if args.warmup > 0:
            await direct.warmup(args.warmup)
        return await run_router_overhead(
            ctx,
            direct,
            pairs=args.pairs,
            max_tokens=args.max_tokens,
            concurrency=args.concurrency,
            requests=args.requests,
            rounds=args.rounds,
        )


def _compare_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs=2, type=Path, metavar="RESULT", help="two result directories (or their summary.json)")
    p.add_argument("--out", type=Path, default=None, help=f"where to write (default {RESULTS_ROOT}/compare-<timestamp>)")
    p.add_argument("--quiet", action="store_true", help="do not print the comparison")
    add_plots_argument(p)


def _compare_main(args: argparse.Namespace) -> int:
    return compare(args.paths[0], args.paths[1], args.out, quiet=args.quiet, plots=args.plots)


# ---------------------------------------------------------------------------
# Running and writing
# ---------------------------------------------------------------------------

WorkloadRun = Callable[[BenchContext, argparse.Namespace], Awaitable[BenchResult]]


def default_out_dir(name: str) -> Path:
    return RESULTS_ROOT / f"{name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def http_workload(name: str, run: WorkloadRun) -> Callable[[argparse.Namespace], int]:
    """The ``main`` of an HTTP workload: sets ``args.out``, runs ``run`` and writes every output."""

    def main(args: argparse.Namespace) -> int:
        args.out = args.out or default_out_dir(name)
        try:
            plots = plots_wanted(f"ember bench {name}", args.plots, quiet=args.quiet)  # before any load is sent
            result = asyncio.run(_run_http(run, args))
        except BenchError as exc:
            print(f"ember bench {name}: {exc}", file=sys.stderr)
            return 2
        return write_outputs(result, args.out, quiet=args.quiet, plots=plots)

    return main


async def _run_http(run: WorkloadRun, args: argparse.Namespace) -> BenchResult:
    if args.http2 and args.transport == "grpc":
        raise BenchError("--http2 and --transport grpc contradict each other")
    transport = "http2" if args.http2 else args.transport
    target = Target(
        url=args.url,
        model=args.model,
        api_key=args.api_key,
        http2=transport == "http2",
        insecure=args.insecure,
        new_connection_per_request=args.new_connection_per_request,
        timeout_s=args.timeout,
        headers=tuple(args.header),
        transport=transport,
        cacert=args.cacert,
    )
    clock = Clock()
    with BenchProgress(quiet=args.quiet) as progress:
        async with make_sender(target, clock) as sender:
            if args.warmup > 0:
                await sender.warmup(args.warmup)
            ctx = BenchContext(sender, clock, args.slo, args.seed, progress, args.ignore_eos)
            return await run(ctx, args)


def write_outputs(result: BenchResult, out_dir: Path, *, quiet: bool = False, plots: bool = True) -> int:
    """Save JSON, Markdown and (with ``plots``) plots; print a summary; exit code 1 when a group completed nothing."""
    save_result(result, out_dir)
    written = write_report(result, out_dir, plots=plots)
    if not quiet:
        print(render_markdown(result, brief=True))
        print(f"\nwrote {out_dir}/: requests.json, summary.json, " + ", ".join(p.name for p in written))
    return 1 if any(g.summary.completed == 0 for g in result.groups) else 0


def compare(path_a: Path, path_b: Path, out_dir: Path | None, *, quiet: bool = False, plots: bool | None = None) -> int:
    """``ember bench compare``: write compare.md and plots (``plots`` as ``--plots``); print the Markdown."""
    out_dir = out_dir or default_out_dir("compare")
    try:
        draw = plots_wanted("ember bench compare", plots, quiet=quiet)
        written = write_comparison(path_a, path_b, out_dir, plots=draw)
    except (BenchError, FileNotFoundError, KeyError, ValueError) as exc:
        print(f"ember bench compare: {exc}", file=sys.stderr)
        return 2
    if not quiet:
        print(written[0].read_text())
        print(f"wrote {out_dir}/: " + ", ".join(p.name for p in written))
    return 0


def workload(name: str, help: str, add_arguments: Callable[[argparse.ArgumentParser], None], run: WorkloadRun) -> Subcommand:
    """A ``Subcommand`` for an HTTP workload: common options, then ``run``, then every output file."""
    return Subcommand(name, help, add_arguments, http_workload(name, run))


SUBCOMMANDS: list[Subcommand] = [
    workload("single", "one stream at a time: TTFT and decode tokens/s", _single_args, _single),
    workload("prefill", "long cache-busted prompts, max_tokens 1: prefill speed", _prefill_args, _prefill),
    workload("load", "closed-loop (--concurrency) or open-loop Poisson (--rate) load", _load_args, _load),
    workload("sweep", "closed-loop grid of concurrency × max_tokens", _sweep_args, _sweep),
    workload("multiturn", "concurrent conversations with growing history: TTFT by turn", _multiturn_args, _multiturn),
    workload("stream-vs-full", "perceived latency: streaming vs the whole reply", _stream_vs_full_args, _stream_vs_full),
    workload("max-tokens", "QPS and latency at max_tokens 50/100/200 (the design's claim, Little's law)", _max_tokens_args, _max_tokens),
    workload("router-overhead", "TTFT and tokens/s through a router vs straight to its replica", _router_overhead_args, _router_overhead),
    Subcommand("compare", "compare two result directories side by side", _compare_args, _compare_main, http=False),
]


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``bench`` and its sub-subcommands (from ``SUBCOMMANDS``) to ``ember``'s subparsers."""
    parser = subparsers.add_parser(
        "bench",
        help="benchmark an OpenAI-compatible server (TTFT, TPOT, ITL, E2E, throughput, goodput)",
        description="Benchmark any OpenAI-compatible chat server. Each workload writes requests.json, "
        "summary.json, summary.md and PNG plots (with matplotlib: pip install 'ember[plots]') into --out.",
    )
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"), default=None, help="same as 'ember bench compare A B'")
    workloads = parser.add_subparsers(dest="workload", metavar="{" + ",".join(s.name for s in SUBCOMMANDS) + "}")
    for command in SUBCOMMANDS:
        sub = workloads.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(sub)
        if command.http:
            add_common_arguments(sub)
        sub.set_defaults(bench_main=command.main)

    def bench_main(args: argparse.Namespace) -> int:
        if getattr(args, "bench_main", None) is not None:
            return args.bench_main(args)
        if args.compare is not None:
            return compare(args.compare[0], args.compare[1], None)
        parser.print_help(sys.stderr)
        return 2

    parser.set_defaults(func=bench_main)
    return parser
