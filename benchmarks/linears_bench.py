"""``python -m benchmarks linears``: the linear layers alone, against this core's ceilings.

Prefill and batched decode spend most of their time in the linear layers, so
this experiment asks how far those are from what the core can issue, and
whether int8 activations would move them:

* the engine's W8A16 layers (``Int8Linear`` on ``linear_w8a16``, the default
  numerics) on the embedded model's shapes (every layer's four linears, then the LM head), in
  multiply-adds per second, for 1, 16 and 1,000 rows (``--rows``): with every layer's
  weights distinct (streamed from memory, as in the engine), the same without
  the kernel's weight prefetch (an earlier default), and with one layer's
  weights reused (in cache: the arithmetic alone);
* the engine's opt-in ``w8a8`` layers (``DynamicInt8Linear``: fbgemm's dynamic
  quantization, 7-bit activations without VNNI) on the same shapes, as a
  second opinion from a well-kept library;
* the ceilings of the inner loops' instruction mixes on this core
  (``multiply_ceiling.cpp``, built here with the system compiler; x86-64 with
  AVX2 only): int16 multiply-adds with and without the weights' sign
  extension, int8 (vpmaddubsw + vpmaddwd) and float32 FMA, times the clock and
  the thread count.

Random weights of the model's shapes: the speed of these kernels does not
depend on the values.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default %(default)s)")
    parser.add_argument(
        "--rounds", type=int, default=5, help="rounds per figure, the variants taking turns; the median (default %(default)s)"
    )
    parser.add_argument("--rows", default="1,16,1000", help="row counts, comma-separated (default %(default)s)")
    parser.add_argument("--out", default=None, help="write figures as JSON here")


def probe_ceilings() -> dict[str, Any] | None:
    """Builds and runs multiply_ceiling.cpp: {"clock_ghz": ..., probe: multiply-adds per cycle}, or None where it cannot run."""
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None or platform.machine() not in ("x86_64", "AMD64"):
        return None
    flags = Path("/proc/cpuinfo").read_text(errors="ignore") if Path("/proc/cpuinfo").exists() else ""
    if " avx2 " not in flags or " fma " not in flags:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / "multiply_ceiling"
        source = Path(__file__).with_name("multiply_ceiling.cpp")
        subprocess.run([compiler, "-O2", "-march=native", str(source), "-o", str(binary)], check=True, capture_output=True)
        lines = subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout.splitlines()
    ceilings: dict[str, Any] = {}
    for line in lines:
        name, *values = line.split()
        if name == "clock_ghz":
            ceilings[name] = float(values[0])
        else:
            cycles, work = float(values[0]), float(values[1])
            ceilings[name] = work / cycles
    return ceilings


def main(args: argparse.Namespace) -> int:
    import torch

    from benchmarks.engine_bench import kernel_path
    from ember.kernels import cpu
    from ember.model.loader import load_model
    from ember.model.quant import Numerics, make_linear

    torch.set_num_threads(args.threads)
    kernels = cpu.load()
    if kernels is None:
        print("the compiled kernels are unavailable here: nothing to measure")
        return 1
    config = load_model(None).config
    h, kv = config.hidden_size, config.num_kv_heads * config.head_dim
    shapes = [(config.q_size + 2 * kv, h), (h, config.q_size), (2 * config.intermediate_size, h), (h, config.intermediate_size)]
    head = (config.vocab_size // 8 * 8, h)
    cpu_device = torch.device("cpu")
    # The engine's own layers: W8A16 lanes (the default) and fbgemm's w8a8 (opt-in).
    w8a16 = Numerics("int8", torch.float32, cpu_device, kernels)
    w8a8 = Numerics("w8a8", torch.float32, cpu_device, kernels)

    def build(numerics: Numerics, layers: int) -> list[torch.nn.Module]:
        return [make_linear(torch.randn(n, k), None, numerics) for _ in range(layers) for n, k in shapes]

    one_layer, distinct, fbgemm_layers = build(w8a16, 1), build(w8a16, config.num_layers), build(w8a8, config.num_layers)
    head_w8a16, head_w8a8 = make_linear(torch.randn(*head), None, w8a16), make_linear(torch.randn(*head), None, w8a8)

    def layer_macs(rows: int) -> int:
        return rows * config.num_layers * sum(n * k for n, k in shapes)

    def run_layers(x: dict[int, torch.Tensor], layers: list[torch.nn.Module]) -> None:
        for layer, (_, k) in zip(layers, shapes * config.num_layers, strict=True):
            layer(x[k])  # each output dropped at once, as the engine's are consumed

    def without_prefetch(x: dict[int, torch.Tensor]) -> None:
        with kernel_path("no-prefetch"):
            run_layers(x, distinct)

    variants = {
        "W8A16 kernel, weights from memory": lambda x: run_layers(x, distinct),
        "the same without the weight prefetch (an earlier default)": without_prefetch,
        "W8A16 kernel, one layer in cache": lambda x: run_layers(x, one_layer * config.num_layers),
        "fbgemm int8 activations (w8a8)": lambda x: run_layers(x, fbgemm_layers),
    }
    head_variants = {"W8A16 kernel, weights from memory": head_w8a16, "fbgemm int8 activations (w8a8)": head_w8a8}
    figures: dict[str, dict[str, float]] = {name: {} for name in variants}
    head_figures: dict[str, dict[str, float]] = {name: {} for name in head_variants}
    row_counts = [int(r) for r in args.rows.split(",")]
    for rows in row_counts:
        x = {k: torch.randn(rows, k) for k in {k for _, k in shapes}}
        times: dict[str, list[float]] = {name: [] for name in variants}
        for variant in variants.values():
            variant(x)  # the first call of a shape pays for allocations
        for round_ in range(args.rounds if rows < 1000 else max(2, args.rounds // 2)):
            order = list(variants) if round_ % 2 == 0 else list(variants)[::-1]
            for name in order:
                started = time.perf_counter()
                variants[name](x)
                times[name].append(time.perf_counter() - started)
        for name in variants:
            figures[name][str(rows)] = layer_macs(rows) / statistics.median(times[name]) / 1e9
        # The LM head: one row of a prompt (its last), every row of a decode step.
        head_rows = 1 if rows == 1000 else rows
        xh = torch.randn(head_rows, h)
        for name, run in head_variants.items():
            run(xh)
            started = time.perf_counter()
            for _ in range(5):
                run(xh)
            head_figures[name][str(head_rows)] = 5 * head_rows * head[0] * head[1] / (time.perf_counter() - started) / 1e9

    ceilings = probe_ceilings()
    _print(figures, head_figures, ceilings, args.threads, config.num_layers, row_counts)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"layers": figures, "lm_head": head_figures, "ceilings": ceilings}, indent=2))
    return 0


def _print(
    figures: dict[str, dict[str, float]],
    head_figures: dict[str, dict[str, float]],
    ceilings: dict[str, Any] | None,
    threads: int,
    layers: int,
    row_counts: list[int],
) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Linear layers, {threads} threads: billions of multiply-adds per second ({layers} layers x 4 linears)")
    table.add_column("kernel")
    for rows in row_counts:
        table.add_column(f"{rows} rows", justify="right")
    for name, by_rows in figures.items():
        table.add_row(name, *(f"{by_rows[str(rows)]:.1f}" for rows in row_counts))
    for name, by_rows in head_figures.items():
        table.add_row(f"LM head: {name}", *(f"{value:.1f} ({rows} rows)" for rows, value in by_rows.items()))
    console = Console()
    console.print(table)
    if ceilings is None:
        console.print("instruction-mix ceilings: not measured (needs an x86-64 CPU with AVX2 and a C++ compiler)")
        return
    ghz = ceilings["clock_ghz"]
    ceiling = Table(title=f"Instruction-mix ceilings on this core ({ghz:.2f} GHz measured) x {threads} threads")
    ceiling.add_column("inner loop")
    ceiling.add_column("multiply-adds / cycle", justify="right")
    ceiling.add_column("billions / s", justify="right")
    names = {
        "int16_madd": "int16 vpmaddwd + vpaddd (no weight extension)",
        "int16_madd_with_extend": "the W8A16 kernel's mix (+ int8 -> int16 extension per 3 rows)",
        "int8_maddubs": "int8 activations: vpmaddubsw + vpmaddwd + vpaddd (no VNNI)",
        "float32_fma": "float32 FMA (attention), 8 lanes",
    }
    for key, label in names.items():
        per_cycle = ceilings[key]
        ceiling.add_row(label, f"{per_cycle:.1f}", f"{per_cycle * ghz * threads:.0f}")
    console.print(ceiling)
