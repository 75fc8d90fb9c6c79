"""The engine as servers see it: the only ``ember.engine`` module they import.

``AsyncEngine`` is the façade (requests, typed commands, the per-step
``EngineSnapshot``, the fixed ``EngineInfo``); the rest are the plain data
types that cross the boundary. ``tests/server/test_engine_boundary.py`` checks
that nothing under ``ember.server`` or ``ember.grpc`` imports other engine,
model or kernel modules.
"""

from ember.engine.async_engine import AsyncEngine
from ember.engine.constraints import INSTALL_HINT as GRAMMAR_INSTALL_HINT
from ember.engine.constraints import Constraint, GrammarSpec, GrammarUnavailableError, InvalidGrammarError
from ember.engine.constraints import is_available as grammar_available
from ember.engine.request import FinishReason, Priority, RequestOutput, TokenLogprob
from ember.engine.sampling import SamplingParams
from ember.engine.stats import EngineCounters, EngineInfo, EngineSnapshot
from ember.model.tokenizer import Tokenizer, check_chat_template_file

__all__ = [
    "GRAMMAR_INSTALL_HINT",
    "AsyncEngine",
    "Constraint",
    "EngineCounters",
    "EngineInfo",
    "EngineSnapshot",
    "FinishReason",
    "GrammarSpec",
    "GrammarUnavailableError",
    "InvalidGrammarError",
    "Priority",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprob",
    "Tokenizer",
    "check_chat_template_file",
    "grammar_available",
]
