"""Small helpers shared by engine tests."""

from __future__ import annotations

from ember.engine.engine import LLMEngine
from ember.engine.request import RequestOutput
from ember.engine.sampling import SamplingParams

# The fixed prompts the accuracy tests compare engine modes on (teacher-forced agreement).
AGREEMENT_PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain photosynthesis to a child.",
    "Give me three tips for learning Python.",
    "What is 12 plus 30?",
    "Describe a cat in one sentence.",
    "Who wrote Romeo and Juliet?",
    "Name the largest ocean on Earth.",
]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def run_all(engine: LLMEngine, max_steps: int = 100_000) -> dict[str, list[RequestOutput]]:
    """Step until every request finished; outputs grouped by request id."""
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return outputs
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError("engine did not finish within max_steps")


def final_tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def final_text(outputs: list[RequestOutput]) -> str:
    return "".join(o.text_delta for o in outputs)


def teacher_forced_logits(engine: LLMEngine, ids: list[int]):
    """Logits (len(ids), vocab) after every position of ``ids``, in one prefill outside the scheduler."""
    import torch

    from ember.engine.request import Request
    from ember.engine.scheduler import ScheduledRequest, SchedulerOutput

    request = Request("teacher-forced", ids, greedy(1), 0.0, max_model_len=engine.max_model_len)
    assert engine.kv.allocate(request, len(ids))
    try:
        sched = SchedulerOutput(prefills=[ScheduledRequest(request, len(ids))])
        input_ids, positions, meta, _, _ = engine.runner._prepare(sched)
        return engine.model(input_ids, positions, meta, engine.kv.layer_caches, torch.arange(len(ids)))
    finally:
        engine.kv.free(request)


def teacher_forced_agreement(reference: LLMEngine, engine: LLMEngine, sequences: list[tuple[list[int], list[int]]]) -> tuple[float, float]:
    """Top-1 agreement with ``reference`` at every generated position, both fed the same tokens; and the mean |logit error|."""
    agree = total = 0
    error = 0.0
    for prompt, continuation in sequences:
        full = prompt + continuation
        want = teacher_forced_logits(reference, full)[len(prompt) - 1 : -1]
        got = teacher_forced_logits(engine, full)[len(prompt) - 1 : -1]
        agree += int((want.argmax(-1) == got.argmax(-1)).sum())
        total += want.shape[0]
        error += float((want - got).abs().mean()) / len(sequences)
    return agree / total, error


def prefill_forward(engine: LLMEngine, ids: list[int], per_layer: bool = False):
    """Run ``ids`` as one fresh prefill through the engine's model, outside the scheduler.

    Returns the last-position logits, or every layer's hidden states with ``per_layer``.
    """
    from ember.engine.request import Request
    from ember.engine.scheduler import ScheduledRequest, SchedulerOutput

    request = Request("direct-forward", ids, greedy(1), 0.0, max_model_len=engine.max_model_len)
    assert engine.kv.allocate(request, len(ids))
    try:
        sched = SchedulerOutput(prefills=[ScheduledRequest(request, len(ids))])
        input_ids, positions, meta, rows, _ = engine.runner._prepare(sched)
        if per_layer:
            return engine.model.layer_outputs(input_ids, positions, meta, engine.kv.layer_caches)
        return engine.model(input_ids, positions, meta, engine.kv.layer_caches, rows)[0]
    finally:
        engine.kv.free(request)
