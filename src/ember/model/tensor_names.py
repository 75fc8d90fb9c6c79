"""A checkpoint tensor's name in Ember's internal scheme (see ``checkpoint.py``)."""

from __future__ import annotations


def internal_name(name: str, top_level: dict[str, str], layer_prefix: str, layer_names: dict[str, str]) -> str | None:
    """Ember's name for a checkpoint tensor (None: a tensor Ember derives itself, like rope_freqs).

    ``top_level`` maps whole names; a name ``{layer_prefix}{i}.{rest}`` becomes
    ``layers.{i}.{layer_names[rest]}``.
    """
    if name in top_level:
        return top_level[name]
    if name.startswith(layer_prefix):
        _, index, rest = name.split(".", 2)
        short = layer_names.get(rest)
        if short is not None:
            return f"layers.{index}.{short}"
    return None
