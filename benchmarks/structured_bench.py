"""``python -m benchmarks structured``: what a JSON-schema constraint costs the engine, in process.

One run measures, with and without a constraint on every request:

* single-stream decode tokens/s (one request; the first token, which is
  prefill, excluded);
* 16-stream decode tokens/s, over the steps where all 16 sequences decode.

Both sides sample at temperature 0.8 with seeds and run exactly
``--tokens`` tokens: free requests ignore EOS, constrained ones follow a schema
that cannot close within that many tokens (an object with at least 50 list
items), so the grammar walks keys, strings and separators the whole time.
Grammars are compiled before the clock starts, as the server does before
admission. Besides wall-clock rates it reports rates per CPU-second of the
process (all its threads): on a shared machine other processes stretch wall
time, not the work a step does, so the CPU figure isolates the constraint's cost.
"""

from __future__ import annotations

import argparse
import statistics
import time

# Long enough to outlast --tokens: at least 50 short lines after a title.
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 30},
        "lines": {"type": "array", "items": {"type": "string", "maxLength": 60}, "minItems": 50},
    },
    "required": ["title", "lines"],
    "additionalProperties": False,
}
PROMPT = [{"role": "user", "content": "Write a poem about the sea as JSON, with a title and its lines."}]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per request")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2, help="single-stream runs per side; the median is reported")


def main(args: argparse.Namespace) -> int:
    import torch

    from ember.config import EngineConfig
    from ember.engine.constraints import GrammarSpec
    from ember.engine.engine import LLMEngine
    from ember.engine.sampling import SamplingParams

    torch.set_num_threads(args.threads)
    engine = LLMEngine(config=EngineConfig(threads=args.threads))
    prompt = engine.tokenizer.encode_chat(PROMPT)
    spec = GrammarSpec.json_schema(SCHEMA)
    engine.grammar.compile(spec)  # the compiler's vocabulary view: built once per engine

    def run(n: int, constrained: bool, seed: int) -> tuple[float, float, float, float]:
        """Tokens/s over decode steps and over steps where all n decode: wall clock, then per CPU-second."""
        engine.kv.pool.reset_prefix_cache()
        for i in range(n):
            params = SamplingParams(max_tokens=args.tokens, temperature=0.8, seed=seed + i, ignore_eos=not constrained)
            constraint = engine.grammar.compile(spec) if constrained else None
            engine.add_request(f"r{seed}-{i}", prompt, params, constraint=constraint)
        decode_tokens, decode_s, full_tokens, full_s, decode_cpu, full_cpu = 0, 0.0, 0, 0.0, 0.0, 0.0
        while engine.has_unfinished():
            started, cpu_started = time.perf_counter(), time.process_time()
            outputs = engine.step()
            elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
            made = sum(len(o.new_token_ids) for o in outputs)
            first = any(o.num_output_tokens == 1 for o in outputs)
            if first:
                continue  # a step holding a prefill measures prefill, not decode
            decode_tokens += made
            decode_s += elapsed
            decode_cpu += cpu
            if made == n:
                full_tokens += made
                full_s += elapsed
                full_cpu += cpu
        return (
            decode_tokens / decode_s,
            full_tokens / max(full_s, 1e-9),
            decode_tokens / max(decode_cpu, 1e-9),
            full_tokens / max(full_cpu, 1e-9),
        )

    run(1, False, 0)  # warm up kernels and caches
    # The two sides alternate, so a change in the machine's load hits both alike.
    single: dict[bool, list[tuple[float, ...]]] = {False: [], True: []}
    batched: dict[bool, list[tuple[float, ...]]] = {False: [], True: []}
    for r in range(args.repeats):
        for constrained in (False, True):
            single[constrained].append(run(1, constrained, 100 * r))
            batched[constrained].append(run(args.concurrency, constrained, 1000 + 100 * r))

    def med(runs: list[tuple[float, ...]], k: int) -> float:
        return statistics.median(x[k] for x in runs)

    print(
        f"python -m benchmarks structured: {args.tokens} tokens per request, temperature 0.8, {args.threads} threads, median of {args.repeats}"
    )
    streams = f"{args.concurrency} streams"
    header = f"{'':18s}{'1 stream tok/s':>16s}{f'{streams} tok/s':>18s}{'1 stream tok/CPU-s':>20s}{f'{streams} tok/CPU-s':>22s}"
    print(header)
    figures = {}
    for constrained, label in ((False, "free text"), (True, "JSON schema")):
        figures[constrained] = (
            med(single[constrained], 0),
            med(batched[constrained], 1),
            med(single[constrained], 2),
            med(batched[constrained], 3),
        )
        a, b, c, d = figures[constrained]
        print(f"{label:18s}{a:16.1f}{b:18.1f}{c:20.1f}{d:22.1f}")
    costs = [100 * (1 - j / f) for f, j in zip(figures[False], figures[True], strict=True)]
    print(f"{'constraint cost':18s}{costs[0]:15.1f}%{costs[1]:17.1f}%{costs[2]:19.1f}%{costs[3]:21.1f}%")
    return 0
