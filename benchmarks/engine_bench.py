"""``python -m benchmarks engine``: the engine alone, in process, next to references measured in the same run.

Figures (issue "Inference engine"):

* single-stream decode tokens/s: one request, 200 tokens, decode phase only
  (first token excluded: that is prefill);
* prefill tokens/s: a 1,000-token prompt of unique tokens, max_tokens 1;
* aggregate decode tokens/s with 16 concurrent sequences (128 tokens each),
  measured over the steps where all 16 decode, greedy and at temperature 0.7 /
  top_p 0.9 with a seed per request (what chat clients send);
* resident weight bytes per parameter, and RSS split into weights, KV pool and
  the rest (runtime);
* the step loop's own overhead: wall time of ``step()`` minus the model's
  forward and sampling, per step.

Speculative decoding is off here (one token per step, kernels against
kernels); ``python -m benchmarks speculation`` measures it on and off.

The same run measures transformers' ``generate`` (float32) on the same GGUF as a
live reference, and llama.cpp through ``llama_cpp`` when that package is
installed. The figures the issue quotes for vLLM and llama.cpp on this machine
are printed as quoted, labelled as such.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Quoted by the engine issue, measured on this machine with 2 threads.
QUOTED_REFERENCES = {
    "llama.cpp 0.3.36 Q4_1 in-process": {"decode_tps": 147.0, "prefill_tps": 360.0},
    "llama.cpp server": {"decode_tps": 84.0},
    "vLLM CPU 0.32.0 bf16": {"decode_tps": 53.0, "prefill_tps": 2065.0, "aggregate_tps": 400.0},
    "transformers generate fp32": {"decode_tps": 24.0},
}
# The kernels' earlier defaults, newest first, run by the same engine (`--modes ...:amx-gather-first`).
KERNEL_PATHS = {
    "amx-gather-first": "previous default (AMX weight tiles gathered first, torch argmax)",
    "no-prefetch": "default before that (no weight prefetch)",
    "avx2": "default before that (one-block AVX2)",
}
# Issue 12 (set on the 2-core AVX-512 machine; this AVX2 one has no VNNI or BF16 dot products).
TARGETS = {"decode_tps": 150.0, "prefill_tps": 2300.0, "aggregate_tps": 700.0}


@dataclass
class EngineFigures:
    mode: str
    decode_tps: float = 0.0
    prefill_tps: float = 0.0
    aggregate_tps: float = 0.0
    aggregate_sampled_tps: float = 0.0
    # The median over rounds of each round's sampled / greedy ratio: the two run back to back
    # (their order alternating), so the ratio holds while this machine's speed drifts.
    sampled_vs_greedy: float = 0.0
    step_overhead_ms: float = 0.0
    weight_bytes_per_param: float = 0.0
    rss_mb: dict[str, float] = field(default_factory=dict)
    load_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model path (default: the embedded model)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument(
        "--modes",
        default="float32:int8,float32:int8:amx-gather-first,float32:int8:previous",
        help="comma-separated dtype:quantization[:previous|:amx-gather-first|:no-prefetch|:avx2] to measure; ':previous' takes the "
        "previous per-shape kernels (--no-batch-invariant); the others the batch-invariant W8A16 kernel as it was before a change: "
        "':amx-gather-first' with a decode step's AMX weight tiles all gathered before any is multiplied and the greedy sampler on "
        "torch's argmax (the previous default), "
        "':no-prefetch' also without its weight prefetch, ':avx2' on its one-block AVX2 code, without its AVX-512 VNNI, AMX and "
        "two-block AVX2 paths; each the same bits",
    )
    parser.add_argument("--decode-tokens", type=int, default=200)
    parser.add_argument("--prefill-tokens", type=int, default=1000)
    parser.add_argument(
        "--repeats", type=int, default=3, help="rounds (decode, prefill, 16 sequences greedy and sampled); the median is reported"
    )
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--aggregate-tokens", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=0, help="max_num_batched_tokens (0: the engine default)")
    parser.add_argument("--no-reference", action="store_true", help="skip the transformers reference run")
    parser.add_argument("--profile", action="store_true", help="print a torch profile of a decode run")
    parser.add_argument("--out", default=None, help="write figures as JSON here")


def main(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(args.threads)
    # Modes that differ only in the W8A16 kernel's path (':no-prefetch', ':avx2') share
    # one engine and take turns round by round: this machine's speed moves by tens
    # of per cent between stretches of minutes, and measured one after the other the
    # same decode kernel read 0.69x of itself.
    engines: dict[tuple[str, str, bool], list[tuple[int, str]]] = {}
    for index, mode in enumerate(args.modes.split(",")):
        dtype, quantization, *flags = mode.split(":")
        path = next((flag for flag in flags if flag in KERNEL_PATHS), "")
        engines.setdefault((dtype, quantization, "previous" not in flags), []).append((index, path))
    measured: dict[int, EngineFigures] = {}
    for (dtype, quantization, batch_invariant), variants in engines.items():
        figures = measure_engine(args, dtype, quantization, batch_invariant, [path for _, path in variants])
        measured.update(zip((index for index, _ in variants), figures, strict=True))
    rows = [measured[index] for index in sorted(measured)]
    reference = None if args.no_reference else measure_transformers(args)
    llama_cpp = measure_llama_cpp(args)
    _print(rows, reference, llama_cpp, args)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(
            json.dumps(
                {"ember": [asdict(r) for r in rows], "transformers": reference, "llama_cpp": llama_cpp, "quoted": QUOTED_REFERENCES},
                indent=2,
            )
        )
    return 0


@contextlib.contextmanager
def kernel_path(path: str) -> Iterator[None]:
    """While inside, the kernels run as ``path`` says (a key of KERNEL_PATHS; "" as they come): the
    greedy sampler on torch's argmax and the AMX weight tiles gathered first (every older path), the
    W8A16 kernel without its weight prefetch, or on its one-block AVX2 code. The same bits either way."""
    from ember.engine import sampler
    from ember.kernels import cpu

    kernels = cpu.load() if path else None
    if kernels is None:
        yield
        return
    previous_ceiling = kernels.set_w8a16_ceiling("avx2") if path == "avx2" else None
    previous_prefetch = kernels.set_w8a16_prefetch(path != "no-prefetch")
    previous_streaming = kernels.set_amx_streaming(False)
    previous_argmax, sampler._argmax = sampler._argmax, lambda logits: logits.argmax(dim=-1)
    try:
        yield
    finally:
        if previous_ceiling is not None:
            kernels.set_w8a16_ceiling(previous_ceiling)
        kernels.set_w8a16_prefetch(previous_prefetch)
        kernels.set_amx_streaming(previous_streaming)
        sampler._argmax = previous_argmax


def _engine(args: argparse.Namespace, dtype: str, quantization: str, batch_invariant: bool):
    from ember.config import EngineConfig
    from ember.engine.engine import LLMEngine

    # Speculation off: these figures compare kernels and arithmetic, one token per step
    # (the previous kernels cannot speculate); `python -m benchmarks speculation` measures it.
    config = EngineConfig(
        dtype=dtype,
        quantization=quantization,
        threads=args.threads,
        enable_prefix_caching=False,
        batch_invariant=batch_invariant,
        num_speculative_tokens=0,
    )
    if args.chunk:
        config = EngineConfig(**{**asdict(config), "max_num_batched_tokens": args.chunk})
    return LLMEngine(args.model, config)


def measure_engine(
    args: argparse.Namespace, dtype: str, quantization: str, batch_invariant: bool = True, variants: list[str] | None = None
) -> list[EngineFigures]:
    """Loads one engine and measures it once per variant, a W8A16 kernel path (a key of KERNEL_PATHS,
    "" for the kernel as it comes). Decode runs switch the variant every step (``_decode``); prefill
    runs take turns within every round (the order reversed every other round). Each figure is the
    median of ``args.repeats`` rounds, so a slow stretch of the machine moves every variant alike."""
    from ember.engine.sampling import SamplingParams

    variants = variants or [""]
    started = time.perf_counter()
    engine = _engine(args, dtype, quantization, batch_invariant)
    load_s = time.perf_counter() - started
    kernels = "batch-invariant" if engine.model.batch_invariant else "previous kernels"
    rows = [EngineFigures(mode=f"{dtype}/{quantization}, {KERNEL_PATHS[path] if path else kernels}", load_s=load_s) for path in variants]
    tok = engine.tokenizer
    greedy = lambda n, i=0: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)  # noqa: E731
    sampled = lambda n, i: SamplingParams(max_tokens=n, temperature=0.7, top_p=0.9, seed=i, ignore_eos=True)  # noqa: E731
    story = tok.encode_chat([{"role": "user", "content": "Tell me a long story about a dragon."}])
    poems = [tok.encode_chat([{"role": "user", "content": f"Write a poem about the number {i}."}]) for i in range(args.concurrency)]

    # Warm-up: first calls pay for allocations and kernel selection.
    engine.add_request("warm", tok.encode_chat([{"role": "user", "content": "Hello"}]), greedy(16))
    _drain(engine)

    runs: list[dict[str, list[float]]] = [{} for _ in variants]

    def record(key: str, values: list[float]) -> None:
        for run, value in zip(runs, values, strict=True):
            run.setdefault(key, []).append(value)

    vocab = engine.model_config.vocab_size - 100
    for round_ in range(args.repeats):
        # Prefill: one forward per variant, taking turns (the order reversed every
        # other round); unique tokens in every run, so no cache can help.
        order = range(len(variants)) if round_ % 2 == 0 else reversed(range(len(variants)))
        for v in order:
            run = round_ * len(variants) + v
            prompt = [(i * 7919 + 13 + 104729 * run) % vocab + 50 for i in range(args.prefill_tokens)]
            with kernel_path(variants[v]):
                t0 = time.perf_counter()
                engine.add_request(f"prefill-{run}", prompt, greedy(1))
                _drain(engine)
                runs[v].setdefault("prefill_tps", []).append(args.prefill_tokens / (time.perf_counter() - t0))
        # Decode: the variants take turns step by step within the same requests.
        record("decode_tps", _decode(engine, [story], lambda i: greedy(args.decode_tokens), variants)[0])
        # 16 sequences greedy and sampled back to back, each first every other round.
        kinds = [("aggregate_tps", greedy), ("aggregate_sampled_tps", sampled)]
        this_round: dict[str, list[float]] = {}
        for key, draw in kinds if round_ % 2 == 0 else kinds[::-1]:
            tps, overhead = _decode(engine, poems, lambda i, draw=draw: draw(args.aggregate_tokens, i), variants)
            this_round[key] = tps
            record(key, tps)
            if key == "aggregate_tps":
                record("step_overhead_ms", [overhead] * len(variants))
        ratios = zip(this_round["aggregate_sampled_tps"], this_round["aggregate_tps"], strict=True)
        record("sampled_vs_greedy", [sampled_tps / max(greedy_tps, 1e-9) for sampled_tps, greedy_tps in ratios])
    weight_bytes_per_param, rss_mb = _memory(engine)
    for figures, measured in zip(rows, runs, strict=True):
        for key, values in measured.items():
            setattr(figures, key, statistics.median(values))
        figures.extra["kernels"] = engine.model.kernels is not None
        figures.extra["chunk"] = engine.scheduler.max_num_batched_tokens
        figures.extra["rounds"] = args.repeats
        figures.weight_bytes_per_param, figures.rss_mb = weight_bytes_per_param, rss_mb
    if args.profile:
        _profile(engine, greedy)
    return rows


def _memory(engine) -> tuple[float, dict[str, float]]:
    """Resident weight bytes per checkpoint parameter, and RSS split into weights, KV pool and the rest."""
    model = engine.model
    seen: set[int] = set()
    weight_bytes = 0
    for t in [*model.parameters(), *model.buffers()]:
        if t is not None and t.data_ptr() not in seen and t is not model.rope and t is not model.rope_cos and t is not model.rope_sin:
            seen.add(t.data_ptr())
            weight_bytes += t.numel() * t.element_size()
    c = engine.model_config
    layer = c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    params = c.num_layers * layer + c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    rss = 0
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    mb = 1024 * 1024
    kv = engine.kv.total_bytes
    return weight_bytes / params, {
        "rss": rss / mb,
        "weights": weight_bytes / mb,
        "kv_pool": kv / mb,
        "runtime": (rss - weight_bytes - kv) / mb,
    }


def _decode(engine, prompts: list[list[int]], params: Callable[[int], Any], variants: list[str]) -> tuple[list[float], float]:
    """Decodes ``prompts`` together to the end, the W8A16 path switching every step, in turn, through
    ``variants``: tokens/s per variant over the steps where every sequence decodes, and the step loop's
    median overhead (ms: wall time of ``step()`` minus the model's forward and sampling).

    Neighbouring steps see the machine in the same mood, so the variants' ratio holds even while this
    machine's speed drifts by tens of per cent from one stretch of seconds to the next."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"decode-{uuid.uuid4().hex}-{i}", prompt, params(i))
    overhead: list[float] = []
    seconds, tokens = [0.0] * len(variants), [0] * len(variants)
    forward_time = [0.0]
    original = engine.runner.execute

    def timed_execute(sched):
        t = time.perf_counter()
        out = original(sched)
        forward_time[0] += time.perf_counter() - t
        return out

    engine.runner.execute = timed_execute
    step = 0
    started: set[str] = set()  # requests past their first token (their prompt's step)
    try:
        while engine.has_unfinished():
            v = step % len(variants)
            step += 1
            with kernel_path(variants[v]):
                before_forward = forward_time[0]
                t = time.perf_counter()
                outs = engine.step()
                wall = time.perf_counter() - t
            overhead.append(wall - (forward_time[0] - before_forward))
            # Only steps where every sequence decodes: a step that also runs a prompt
            # (always the first, so always the first variant's) would tilt the ratio.
            if len(outs) == len(prompts) and all(o.new_token_ids and o.request_id in started for o in outs):
                seconds[v] += wall
                tokens[v] += len(outs)
            started.update(o.request_id for o in outs if o.new_token_ids)
    finally:
        engine.runner.execute = original
    overhead.sort()
    return [n / s if s else 0.0 for n, s in zip(tokens, seconds, strict=True)], 1000 * overhead[len(overhead) // 2]


def _drain(engine) -> dict[str, list[float]]:
    """Step to completion; arrival time of every token per request."""
    stamps: dict[str, list[float]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids:
                stamps.setdefault(out.request_id, []).append(time.perf_counter())
    return stamps


def _profile(engine, greedy) -> None:
    from torch.profiler import profile

    engine.add_request("prof", engine.tokenizer.encode("Once upon a time"), greedy(50))
    with profile() as prof:
        _drain(engine)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def measure_transformers(args: argparse.Namespace) -> dict[str, float] | None:
    """transformers' greedy generate on the same GGUF, float32: the live reference."""
    try:
        import torch
        import transformers
    except ImportError:
        return None
    from ember.model.loader import resolve_model_path

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = resolve_model_path(args.model)
    folder, name = os.path.split(path)
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "Tell me a long story about a dragon."}], add_generation_prompt=True, return_tensors="pt"
    )
    ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
    n = min(args.decode_tokens, 100)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, do_sample=False)
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=1, do_sample=False)
        first = time.perf_counter() - t
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        total = time.perf_counter() - t
        prompt = torch.tensor([[(i * 7919 + 13) % 49000 + 50 for i in range(args.prefill_tokens)]])
        t = time.perf_counter()
        model(prompt)
        prefill = time.perf_counter() - t
    return {"decode_tps": (n - 1) / max(total - first, 1e-9), "prefill_tps": args.prefill_tokens / prefill}


def measure_llama_cpp(args: argparse.Namespace) -> dict[str, float] | None:
    """llama.cpp through llama-cpp-python, when installed (not a dependency)."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    from ember.model.loader import resolve_model_path

    llm = Llama(resolve_model_path(args.model), n_threads=args.threads, n_ctx=4096, verbose=False)
    t = time.perf_counter()
    llm("Tell me a long story about a dragon.", max_tokens=args.decode_tokens, temperature=0)
    decode = args.decode_tokens / (time.perf_counter() - t)
    return {"decode_tps": decode}


def _print(
    rows: list[EngineFigures], reference: dict[str, float] | None, llama_cpp: dict[str, float] | None, args: argparse.Namespace
) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"Engine alone, {args.threads} threads (decode {args.decode_tokens} tokens, prefill {args.prefill_tokens}, {args.concurrency} concurrent)"
    )
    for column in (
        "",
        "decode tok/s",
        "prefill tok/s",
        f"{args.concurrency}-seq tok/s",
        "sampled",
        "weight B/param",
        "step overhead ms",
        "load s",
    ):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(
            f"Ember {r.mode}",
            f"{r.decode_tps:.1f}",
            f"{r.prefill_tps:.0f}",
            f"{r.aggregate_tps:.0f}",
            f"{r.aggregate_sampled_tps:.0f} ({r.sampled_vs_greedy:.2f}x)",
            f"{r.weight_bytes_per_param:.2f}",
            f"{r.step_overhead_ms:.2f}",
            f"{r.load_s:.1f}",
        )
    if reference:
        table.add_row("transformers fp32 (this run)", f"{reference['decode_tps']:.1f}", f"{reference['prefill_tps']:.0f}", "", "", "")
    if llama_cpp:
        table.add_row("llama.cpp (this run)", f"{llama_cpp['decode_tps']:.1f}", "", "", "", "")
    for name, figures in QUOTED_REFERENCES.items():
        cells = [f"{figures[k]:.0f}" if k in figures else "" for k in ("decode_tps", "prefill_tps", "aggregate_tps")]
        table.add_row(f"{name} (quoted)", *cells, "", "")
    table.add_row("target", *(f"{TARGETS[k]:.0f}" for k in ("decode_tps", "prefill_tps", "aggregate_tps")), ">= 0.95x", "<= 1.3", "", "")
    console = Console(width=max(Console().width, 150))
    console.print(table)
    if len(rows) > 1:
        base, *others = rows
        for other in others:
            ratios = ", ".join(
                f"{name} {getattr(base, key) / max(getattr(other, key), 1e-9):.2f}x"
                for name, key in (("decode", "decode_tps"), ("prefill", "prefill_tps"), (f"{args.concurrency} seq", "aggregate_tps"))
            )
            console.print(f"{base.mode} vs {other.mode} (same run): {ratios}")
    for r in rows:
        m = r.rss_mb
        console.print(
            f"RSS after {r.mode}: {m['rss']:.0f} MB = weights {m['weights']:.0f} + KV pool {m['kv_pool']:.0f} + runtime {m['runtime']:.0f}"
        )
