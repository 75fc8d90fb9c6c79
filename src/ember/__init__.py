"""Ember: low-latency LLM chat serving.

Public API: ``LLM`` and ``SamplingParams`` (offline generation), ``Client`` and
``AsyncClient`` (the SDK, ``ember.client``). Names load lazily so that the
client SDK does not import torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "CompletionOutput", "SamplingParams", "Client", "AsyncClient"]
__version__ = "0.1.0"

_LOCATIONS = {
    "LLM": "ember.engine.llm",
    "CompletionOutput": "ember.engine.llm",
    "SamplingParams": "ember.engine.sampling",
    "Client": "ember.client",
    "AsyncClient": "ember.client",
}


def __getattr__(name: str) -> Any:
    module = _LOCATIONS.get(name)
    if module is None:
        raise AttributeError(f"module 'ember' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
