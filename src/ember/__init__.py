"""Ember: low-latency LLM chat serving.

Public API: ``LLM`` and ``SamplingParams`` (offline generation), ``Client`` and
``AsyncClient`` (the SDK, ``ember.client``). Names load lazily so that the
client SDK does not import torch.
"""

from __future__ import annotations

import os
from typing import Any

# How long an OpenMP thread waiting at a barrier spins before it sleeps. libgomp
# reads this once, when torch loads it, so it is set here, before anything of
# Ember imports torch (a value already in the environment wins). libgomp's
# default spins ~300,000 times (milliseconds): fast on an idle machine, but when
# the cores are shared (a client, a router, CI) a thread whose partner was
# descheduled burns its time slice at every barrier, and decode collapsed to a
# few tokens/s. See engine/compute_threads.py and the README ("Threads").
os.environ.setdefault("GOMP_SPINCOUNT", "5000")

__all__ = ["LLM", "AsyncClient", "Client", "CompletionOutput", "SamplingParams"]
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
