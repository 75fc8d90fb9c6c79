"""``LLM``: offline, synchronous generation for scripts, tests and benchmarks."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

from ember.config import EngineConfig
from ember.engine.engine import LLMEngine
from ember.engine.request import FinishReason, RequestOutput, TokenLogprob
from ember.engine.sampling import SamplingParams

Conversation = Sequence[dict[str, Any]]
Prompt = str | Conversation | Sequence[int]


@dataclass
class CompletionOutput:
    """The finished result of one prompt."""

    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: FinishReason
    stop_reason: str | int | None
    num_cached_tokens: int
    logprobs: list[TokenLogprob]


class LLM:
    """Load a model once, then ``generate`` for many prompts at a time.

    A prompt is a string (used as is), a conversation (a list of
    ``{"role", "content"}`` dicts, rendered with the chat template) or a list
    of token ids.

    >>> llm = LLM(dtype="float32", quantization="none")
    >>> llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))[0].text
    """

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        config = replace(EngineConfig(), **engine_options)
        self.engine = LLMEngine(model, config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if prompt and isinstance(prompt[0], dict):
            return self.tokenizer.encode_chat(prompt)  # type: ignore[arg-type]
        return [int(t) for t in cast(Sequence[int], prompt)]

    def generate(
        self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[CompletionOutput]:
        """Run every prompt to completion with continuous batching; results in input order."""
        if params is None or isinstance(params, SamplingParams):
            params_list = [params or SamplingParams()] * len(prompts)
        else:
            params_list = list(params)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} SamplingParams for {len(prompts)} prompts: give one, or one per prompt")
        order: dict[str, int] = {}
        texts: dict[str, list[str]] = {}
        prompt_ids: dict[str, list[int]] = {}
        finals: dict[str, RequestOutput] = {}
        requests = {}
        for i, (prompt, p) in enumerate(zip(prompts, params_list, strict=True)):
            request_id = f"llm-{next(self._ids)}"
            ids = self.encode(prompt)
            requests[request_id] = self.engine.add_request(request_id, ids, p)
            order[request_id] = i
            texts[request_id] = []
            prompt_ids[request_id] = ids
        while len(finals) < len(order):
            for out in self.engine.step():
                texts[out.request_id].append(out.text_delta)
                if out.finished:
                    finals[out.request_id] = out
        results: list[CompletionOutput | None] = [None] * len(order)
        for request_id, out in finals.items():
            request = requests[request_id]
            results[order[request_id]] = CompletionOutput(
                text="".join(texts[request_id]),
                token_ids=request.output_token_ids,
                prompt_token_ids=prompt_ids[request_id],
                finish_reason=out.finish_reason or FinishReason.LENGTH,
                stop_reason=out.stop_reason,
                num_cached_tokens=out.num_cached_tokens,
                logprobs=list(request.logprobs),
            )
        return results  # type: ignore[return-value]
