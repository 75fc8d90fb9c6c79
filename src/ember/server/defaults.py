"""The sampling values a request gets for the fields it leaves out.

Precedence, most specific first: the request's own field, then
``--default-temperature`` / ``--default-top-p``, then the model's own
recommendation (generation_config.json or GGUF ``general.sampling.*``), then
the ``--profile`` preset. A pure function of those three, so ``/v1/models``
shows exactly what requests get.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ember.config import PROFILE_PRESETS

# Sampling fields a default may set, and the value that means "off" when no source sets one.
_NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


@dataclass(frozen=True)
class GenerationDefaults:
    """Resolved defaults and where each came from ("request" never appears: it is the caller's)."""

    values: dict[str, float] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)

    def get(self, name: str) -> Any:
        return self.values[name]

    def card(self) -> dict[str, Any]:
        """How ``/v1/models`` shows them."""
        return {**self.values, "sources": dict(self.sources)}


def resolve_defaults(
    profile: str, model_defaults: dict[str, float], default_temperature: float | None = None, default_top_p: float | None = None
) -> GenerationDefaults:
    """The defaults for ``profile`` on a model recommending ``model_defaults``, with the CLI overrides."""
    preset = PROFILE_PRESETS[profile]
    values: dict[str, Any] = dict(_NEUTRAL)
    sources = dict.fromkeys(_NEUTRAL, "ember")
    values.update(temperature=preset.temperature, top_p=preset.top_p, max_tokens=preset.max_tokens)
    sources.update(temperature="profile", top_p="profile", max_tokens="profile")
    for name, value in model_defaults.items():
        if name in _NEUTRAL:
            values[name] = int(value) if name == "top_k" else float(value)
            sources[name] = "model"
    for name, override in (("temperature", default_temperature), ("top_p", default_top_p)):
        if override is not None:
            values[name] = override
            sources[name] = "server"
    return GenerationDefaults(values, sources)
