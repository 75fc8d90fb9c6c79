"""``python -m benchmarks speculation``: speculative decoding on vs off, through HTTP and in process, in one run.

Workloads, each one stream at temperature 0 (the answers are identical on and
off; the run checks it):

* **rewrite**: "Rewrite this paragraph with the spelling fixed: <~170 words>";
* **code**: "Add type hints to this function and return the whole function
  in a code block: <a 12-line function>";
* the same two with ``prediction`` set to the original text (OpenAI's
  Predicted Outputs);
* **story**: the open-ended story prompt (200 tokens, ignore_eos): text that
  rarely repeats its prompt, where speculation must not cost anything.

Each is measured through ``ember serve`` (``make serve``'s defaults; "off" is
``--num-speculative-tokens 0``) with an httpx SSE client, and with an
``LLMEngine`` in this process, both settings; on and off run side by side,
their requests alternating, so drift in the machine's speed falls on both. Figures: decode tokens/s (first
to last token), end to end, the on/off ratio, and the acceptance rate
(accepted / drafted tokens, from the server's ``llm_spec_*`` counters and the
engine's). Targets (issue 12): input-grounded >= 1.8x, story >= 0.97x.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.servers import ServerProcess, metric_value

PARAGRAPH = (
    "It was a bright cold day in April, and the clocks were striking thirteen. Winston Smith, his chin nuzzled into his breast "
    "in an effort to escape the vile wind, slipped quickly through the glass doors of Victory Mansions, though not quickly enough "
    "to prevent a swirl of gritty dust from entering along with him. The hallway smelt of boiled cabbage and old rag mats. At one "
    "end of it a coloured poster, too large for indoor display, had been tacked to the wall. It depicted simply an enormous face, "
    "more than a metre wide: the face of a man of about forty-five, with a heavy black moustache and ruggedly handsome features. "
    "Winston made for the stairs. It was no use trying the lift."
)
TYPOS = {"bright": "brigth", "quickly": "quikcly", "enormous": "enormus", "features": "featueres", "stairs": "stiars"}
CODE = """def merge_intervals(intervals):
    if not intervals:
        return []
    intervals = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(intervals[0])]
    for start, end in intervals[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return [tuple(pair) for pair in merged]
"""


def _misspelled(text: str) -> str:
    for right, wrong in TYPOS.items():
        text = text.replace(right, wrong)
    return text


@dataclass(frozen=True)
class Workload:
    name: str
    prompt: str
    prediction: str | None
    max_tokens: int
    ignore_eos: bool = False
    grounded: bool = True  # the answer repeats its input: target 1.8x; else 0.97x


WORKLOADS = [
    Workload("rewrite", "Rewrite this paragraph with the spelling fixed: " + _misspelled(PARAGRAPH), None, 300),
    Workload(
        "code", "Add type hints to this function and return the whole function in a code block:\n```python\n" + CODE + "```", None, 300
    ),
    Workload("rewrite + prediction", "Rewrite this paragraph with the spelling fixed: " + _misspelled(PARAGRAPH), PARAGRAPH, 300),
    Workload(
        "code + prediction",
        "Add type hints to this function and return the whole function in a code block:\n```python\n" + CODE + "```",
        "```python\n" + CODE + "```",
        300,
    ),
    Workload("story", "Write a long story about a dragon who learns to cook.", None, 200, ignore_eos=True, grounded=False),
]


@dataclass
class Run:
    """One workload on one path: medians over the repeats."""

    decode_tps: float
    e2e_s: float
    tokens: int
    drafted: float
    accepted: float
    text: str

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else float("nan")


def _http_once(base: str, w: Workload) -> tuple[float, float, int, str]:
    import httpx

    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": w.prompt}],
        "max_tokens": w.max_tokens,
        "temperature": 0,
        "ignore_eos": w.ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if w.prediction is not None:
        body["prediction"] = {"type": "content", "content": w.prediction}
    started = time.perf_counter()
    first = last = None
    text, tokens = [], 0
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", ()):
                if piece := (choice.get("delta") or {}).get("content"):
                    last = time.perf_counter()
                    first = first or last
                    text.append(piece)
    assert first is not None and last is not None
    return (tokens - 1) / max(last - first, 1e-9), time.perf_counter() - started, tokens, "".join(text)


def spec_counters(server: ServerProcess) -> tuple[float, float]:
    """The server's ``llm_spec_*`` counters: tokens drafted, and of those accepted."""
    text = server.metrics()
    return metric_value(text, "llm_spec_draft_tokens_total", default=0.0), metric_value(text, "llm_spec_accepted_tokens_total", default=0.0)


def _run_of(samples: list[tuple[float, float, int, str]], drafted: float, accepted: float) -> Run:
    return Run(
        statistics.median(s[0] for s in samples), statistics.median(s[1] for s in samples), samples[0][2], drafted, accepted, samples[0][3]
    )


def measure_http(settings: dict[str, int], runs: int, threads: int) -> dict[str, dict[str, Run]]:
    """Both servers up at once, their requests alternating (off, on, off, on ...) so that drift
    in the machine's speed falls on both; an idle server sleeps in its engine loop."""
    servers = {label: ServerProcess("--num-speculative-tokens", str(k), threads=threads) for label, k in settings.items()}
    results: dict[str, dict[str, Run]] = {label: {} for label in settings}
    try:
        for server in servers.values():
            server.wait_ready()
            _http_once(server.base, WORKLOADS[-1])  # warm up
        for w in WORKLOADS:
            samples: dict[str, list[tuple[float, float, int, str]]] = {label: [] for label in settings}
            before = {label: spec_counters(server) for label, server in servers.items()}
            for _ in range(runs):
                for label, server in servers.items():
                    samples[label].append(_http_once(server.base, w))
            for label, server in servers.items():
                after = spec_counters(server)
                drafted, accepted = ((a - b) / runs for a, b in zip(after, before[label], strict=True))
                results[label][w.name] = _run_of(samples[label], drafted, accepted)
    finally:
        for server in servers.values():
            server.stop()
    return results


def measure_in_process(settings: dict[str, int], runs: int, threads: int) -> dict[str, dict[str, Run]]:
    """Both engines in this process, their requests alternating as in ``measure_http``."""
    from ember.config import EngineConfig
    from ember.engine.engine import LLMEngine
    from ember.engine.sampling import SamplingParams
    from ember.model.loader import load_model

    loaded = load_model(None)
    engines = {
        label: LLMEngine(config=EngineConfig(threads=threads, num_speculative_tokens=k), loaded=loaded) for label, k in settings.items()
    }
    results: dict[str, dict[str, Run]] = {label: {} for label in settings}
    for w in WORKLOADS:
        samples: dict[str, list[tuple[float, float, int, str]]] = {label: [] for label in settings}
        counts = {label: [0, 0] for label in settings}
        for i in range(runs):
            for label, engine in engines.items():
                tok = engine.tokenizer
                engine.kv.pool.reset_prefix_cache()
                prediction = tok.encode(w.prediction, add_bos=False) if w.prediction else None
                params = SamplingParams(max_tokens=w.max_tokens, temperature=0.0, ignore_eos=w.ignore_eos)
                engine.add_request(f"{w.name}-{i}", tok.encode_chat([{"role": "user", "content": w.prompt}]), params, prediction=prediction)
                first = last = None
                tokens: list[int] = []
                started = time.perf_counter()
                while engine.has_unfinished():
                    for out in engine.step():
                        if out.new_token_ids:
                            last = time.perf_counter()
                            first = first or last
                            tokens += out.new_token_ids
                        if out.finished and out.speculation is not None:
                            counts[label][0] += out.speculation.draft_tokens
                            counts[label][1] += out.speculation.accepted_tokens
                assert first is not None and last is not None
                elapsed = time.perf_counter() - started
                samples[label].append(((len(tokens) - 1) / max(last - first, 1e-9), elapsed, len(tokens), tok.decode(tokens)))
        for label in settings:
            results[label][w.name] = _run_of(samples[label], counts[label][0] / runs, counts[label][1] / runs)
    return results


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runs", type=int, default=3, help="repeats per workload and path (median)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--speculative-tokens", type=int, default=8, help="the 'on' setting (make serve's default)")
    p.add_argument("--skip-in-process", action="store_true")
    p.add_argument("--out", default="bench-results/speculation.json")


def main(args: argparse.Namespace) -> int:
    settings = {"off": 0, "on": args.speculative_tokens}
    paths: dict[str, dict[str, Run]] = {}
    for label, runs in measure_http(settings, args.runs, args.threads).items():
        paths[f"HTTP {label}"] = runs
    if not args.skip_in_process:
        for label, runs in measure_in_process(settings, args.runs, args.threads).items():
            paths[f"in process {label}"] = runs
    print(f"\nSpeculative decoding, one stream, temperature 0, {args.runs} runs each (median); decode tok/s, on / off, acceptance")
    print("| workload | path | off tok/s | on tok/s | on / off | target | e2e off -> on (s) | tokens | accepted / drafted |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    report: list[dict[str, Any]] = []
    same = True
    for w in WORKLOADS:
        for where in ("HTTP", "in process"):
            if f"{where} on" not in paths:
                continue
            off, on = paths[f"{where} off"][w.name], paths[f"{where} on"][w.name]
            same &= off.text == on.text
            ratio = on.decode_tps / off.decode_tps
            target = 1.8 if w.grounded else 0.97
            print(
                f"| {w.name} | {where} | {off.decode_tps:.1f} | {on.decode_tps:.1f} | **{ratio:.2f}x** | >= {target}x "
                f"{'met' if ratio >= target else 'MISSED'} | {off.e2e_s:.2f} -> {on.e2e_s:.2f} | {on.tokens} | "
                f"{on.accepted:.0f} / {on.drafted:.0f} ({on.acceptance:.0%}) |"
            )
            report.append({"workload": w.name, "path": where, "off": off.__dict__, "on": on.__dict__, "ratio": ratio, "target": target})
    print(f"\nanswers identical on and off: {'yes' if same else 'NO'}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    return 0 if same else 1
