"""Stalls of the whole process that the server removes, and the one it measures.

Measured on the 2-core machine (issue 14, item 7), a burst right after start
stalled the event loop for ~150-400 ms, which every request in flight paid:

* **A full garbage collection over the model's heap.** Loading leaves ~225k
  tracked objects (modules, the tokenizer, the model's Python objects); a
  generation-2 pass over them took 150-310 ms, holding the GIL, so the event
  loop and the engine thread both stopped. None of those objects is ever
  garbage. ``freeze_heap`` moves them into the permanent generation once the
  model is loaded and warmed up: later collections only walk what requests
  allocate (a full pass then took under 1 ms).
* **First-use imports.** anyio imports its submodules lazily, on the first
  attribute access: the first streamed reply paid ~9 ms to import its socket
  and stream modules (far more from a fresh clone, which also compiles
  them). ``preload_lazy_imports`` touches them at start-up instead.

``GCPauses`` reports every collection's duration in
``llm_gc_pause_seconds{generation}``, so a regression shows on a dashboard
rather than as an unexplained p99.
"""

from __future__ import annotations

import gc
import time
import warnings
from collections.abc import Callable
from typing import Any


def preload_lazy_imports() -> None:
    """Import now what would otherwise be imported on a request's path."""
    import anyio

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated aliases warn when touched
        for name in dir(anyio):
            try:
                getattr(anyio, name)
            except Exception:  # an optional backend missing here: nothing a request would use
                pass


def freeze_heap() -> None:
    """Collect once, then exempt every surviving object from future collections.

    Call when start-up is over (model loaded, warm-up done): what survives is
    long-lived by construction.
    """
    gc.collect()
    gc.freeze()


class GCPauses:
    """Reports each garbage collection's duration to ``observe(generation, seconds)``.

    A ``gc.callbacks`` hook: it runs in whatever thread triggered the
    collection, which holds the GIL meanwhile, so start and stop never
    interleave. Two ``perf_counter`` calls per collection.
    """

    def __init__(self, observe: Callable[[int, float], None]) -> None:
        self._observe = observe
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self._observe(info["generation"], time.perf_counter() - self._started)

    def close(self) -> None:
        """Stop reporting."""
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
