"""OpenAI request fields Ember does not implement: refused by name, never ignored.

An application that sends ``audio`` or ``web_search_options`` relies on them; a 200
that silently drops them is the worst answer. Each field below is a 400 with
``param`` naming it, unless its value asks for nothing beyond what Ember does
anyway (null, ``store: false``, ``modalities: ["text"]`` ...). Fields that are
not OpenAI's at all are still ignored, as OpenAI's API does.

tests/server/test_unsupported_fields.py walks the fields the installed
``openai`` client can send, so a field added to the client and not handled
here fails the suite.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from ember.server.errors import APIError, bad_request

# Chat fields and the values that are harmless (the field's "off").
CHAT_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "audio": (),
    "modalities": (["text"],),
    "web_search_options": (),
    "functions": (),  # the deprecated spelling of tools
    "function_call": ("none",),
    "store": (False,),
    "metadata": (),
    "service_tier": ("auto", "default"),
    "reasoning_effort": (),
    "verbosity": (),
    "moderation": (),
    "prompt_cache_key": (),
    "prompt_cache_options": (),
    "prompt_cache_retention": (),
    "safety_identifier": (),
}

COMPLETION_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "suffix": ("",),
    "best_of": (1,),
}

_HINTS = {
    "functions": " Use 'tools' instead.",
    "function_call": " Use 'tool_choice' instead.",
    "audio": " Ember generates text only.",
    "modalities": " Ember generates text only.",
}


def refuse_unsupported(body: BaseModel, table: dict[str, tuple[Any, ...]]) -> None:
    """Raise a 400 naming the first field of ``table`` that ``body`` sets to a value Ember cannot honour."""
    extra = body.model_extra or {}
    for name, harmless in table.items():
        if name not in extra:
            continue
        value = extra[name]
        if value is None or any(value == ok for ok in harmless):
            continue
        raise bad_request(f"The parameter '{name}' is not supported by this server.{_HINTS.get(name, '')}", name, "unsupported_parameter")


def unsupported_value(message: str, param: str) -> APIError:
    """A 400 for a supported field used with a value Ember cannot honour."""
    return bad_request(message, param, "unsupported_value")
