"""Ember: low-latency LLM chat serving.

Public API: ``LLM`` and ``SamplingParams`` (offline generation), ``AsyncEngine``
(what the server runs on), ``Client`` / ``AsyncClient`` (``ember.client``).
"""

from ember.engine.llm import LLM, CompletionOutput
from ember.engine.sampling import SamplingParams

__all__ = ["LLM", "CompletionOutput", "SamplingParams"]
__version__ = "0.1.0"
