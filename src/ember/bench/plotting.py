"""Whether ``ember bench`` draws its PNG plots: matplotlib is the optional ``plots`` extra.

``--plots`` asks for them (an error, before any load is sent, when matplotlib
is missing), ``--no-plots`` turns them off, and neither draws them when
matplotlib is installed and writes the Markdown alone, with a note, when it is not.
"""

from __future__ import annotations

import importlib.util

from ember.bench.sender import BenchError

PLOTS_EXTRA = "pip install 'ember[plots]'"


def matplotlib_installed() -> bool:
    """True when matplotlib can be imported (found, not imported: it is slow to import)."""
    return importlib.util.find_spec("matplotlib") is not None


def resolve_plots(asked: bool | None, installed: bool) -> bool:
    """Draw plots or not: ``asked`` is ``--plots`` (True), ``--no-plots`` (False) or neither (None).

    Raises ``BenchError`` naming the extra when plots are asked for and matplotlib is not installed.
    """
    if asked and not installed:
        raise BenchError(f"plots need matplotlib, which is not installed: {PLOTS_EXTRA} (or pass --no-plots)")
    return installed if asked is None else asked


def skipped_plots_note(asked: bool | None, installed: bool) -> str | None:
    """The line to print when plots are left out only because matplotlib is missing, else None."""
    if asked is None and not installed:
        return f"no plots: matplotlib is not installed ({PLOTS_EXTRA}); the Markdown and JSON are written"
    return None
