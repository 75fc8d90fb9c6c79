"""``ember bench``: load generator and metrics for any OpenAI-compatible chat server.

Building blocks for other benchmarks (an overload test, an engine benchmark)::

    from ember.bench import Clock, Sender, Target, run_open_loop, summarize, story_requests

    clock = Clock()
    async with Sender(Target(url), clock) as sender:
        run = await run_open_loop(sender.send, story_requests(64, ignore_eos=True),
                                  rate=8.0, seed=0, clock=clock, duration_s=60)
    summary = summarize(run.records, run.duration_s, parse_slo("ttft=0.5,e2e=5"))

Modules: ``workloads`` (what to send), ``sender`` (one request over httpx),
``loadgen`` (closed loop, open loop, conversations), ``record`` (one request's
timings), ``metrics`` (TTFT, TPOT, ITL, E2E, throughput, goodput), ``result``
(JSON files), ``report`` (Markdown), ``plots`` (PNG, the ``plots`` extra),
``compare``, ``cli``. The project's own experiments (servers it starts itself,
quoted targets) are in the repository's ``benchmarks/``, not in this package.
"""

from ember.bench.loadgen import RunResult, poisson_arrival_times, run_closed_loop, run_conversations, run_open_loop
from ember.bench.metrics import SLO, Stats, Summary, describe, parse_slo, percentile, stats_by, summarize
from ember.bench.record import Clock, RequestRecord, load_records, save_records
from ember.bench.result import BenchResult, Group, Section, load_result, make_group, save_result
from ember.bench.sender import BenchError, Sender, Target
from ember.bench.workloads import Conversation, RequestSpec, prefill_requests, story_requests

__all__ = [
    "SLO",
    "BenchError",
    "BenchResult",
    "Clock",
    "Conversation",
    "Group",
    "RequestRecord",
    "RequestSpec",
    "RunResult",
    "Section",
    "Sender",
    "Stats",
    "Summary",
    "Target",
    "describe",
    "load_records",
    "load_result",
    "make_group",
    "parse_slo",
    "percentile",
    "poisson_arrival_times",
    "prefill_requests",
    "run_closed_loop",
    "run_conversations",
    "run_open_loop",
    "save_records",
    "save_result",
    "stats_by",
    "story_requests",
    "summarize",
]
