"""Every default the README, ``docs/`` and ``deploy/`` quote is the default the code has.

Defaults live in ``ember.config`` and reach the CLI from there; the docs quote
them by hand, which is how ``deploy/`` came to say ``--max-queue`` 256 while
the server used 64. Quotes are recognised in the forms the docs use:

* ``--flag`` followed by its value in parentheses: "`--hot-ttl` (300 s)";
* "default" then the flag and its value: "the default `--max-queue` 64",
  "default --max-queue 64", "(default `--request-timeout 10`)";
* a flag, some words, then "(default N": "`--write-behind` seconds (default 1";
* the profile presets: "`--profile support` (max_tokens 80, temperature 0.2, top_p 0.9".

Each quoted value is compared with the default of the CLI option of that name
(any ``ember`` subcommand that has it); a quoted flag no command has fails too.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from ember.cli import build_parser
from ember.config import PROFILE_PRESETS

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "deploy").rglob("*.md")), *sorted((ROOT / "deploy").rglob("*.yml"))]
NUMBER = r"(-?[0-9][0-9,]*(?:\.[0-9]+)?)"
FLAG = r"--([a-z0-9][a-z0-9-]*)"
PATTERNS = [
    re.compile(rf"`{FLAG}`\s*\({NUMBER}(?:\s*(?:s|ms|MiB|MB))?[\s,:;)]"),
    re.compile(rf"\bdefault\s+`?{FLAG}`?\s+{NUMBER}\b"),
    re.compile(rf"\(default\s+`{FLAG}\s+{NUMBER}`"),
    re.compile(rf"`{FLAG}`[a-z ]{{0,40}}\(default\s+{NUMBER}\b"),
]
PRESET = re.compile(r"`--profile ([a-z]+)`\s*\((?:max_tokens\s+)?([0-9]+),\s*(?:temperature\s+)?([0-9.]+),\s*(?:top_p\s+)?([0-9.]+)")
# Flags the issue found misquoted or that this change introduced: the scan must see them.
MUST_BE_QUOTED = {"max-queue", "slo-window", "slo-eval-window", "slo-queue-p99", "slo-itl-p99", "slo-min-samples", "request-timeout", "hot-ttl"}


def cli_defaults() -> dict[str, list[object]]:
    """Every option of every ``ember`` subcommand (and sub-subcommand), flag name -> its defaults."""
    defaults: dict[str, list[object]] = {}

    def walk(parser: argparse.ArgumentParser) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child in action.choices.values():
                    walk(child)
                continue
            for option in action.option_strings:
                if option.startswith("--"):
                    defaults.setdefault(option[2:], []).append(action.default)

    walk(build_parser())
    return defaults


def quotes() -> list[tuple[str, str, str]]:
    """(document, flag, quoted value) for every default quoted in the docs."""
    found = []
    for path in DOCS:
        text = path.read_text()
        for pattern in PATTERNS:
            for match in pattern.finditer(text):
                found.append((str(path.relative_to(ROOT)), match.group(1), match.group(2)))
    return found


def as_number(text: str) -> float:
    return float(text.replace(",", ""))


def test_the_scan_sees_the_quotes_that_matter() -> None:
    seen = {flag for _, flag, _ in quotes()}
    assert MUST_BE_QUOTED <= seen, sorted(MUST_BE_QUOTED - seen)


@pytest.mark.parametrize("doc,flag,value", quotes(), ids=[f"{d}:{f}={v}" for d, f, v in quotes()])
def test_a_quoted_default_is_the_cli_default(doc: str, flag: str, value: str) -> None:
    defaults = cli_defaults()
    assert flag in defaults, f"{doc} quotes a default for --{flag}, which no ember command has"
    numeric = {float(d) for d in defaults[flag] if isinstance(d, (int, float)) and not isinstance(d, bool)}
    assert as_number(value) in numeric, f"{doc} says --{flag} defaults to {value}; the CLI says {sorted(defaults[flag], key=str)}"


def test_quoted_profile_presets_are_the_configured_ones() -> None:
    found = [(m.group(1), m.groups()[1:]) for path in DOCS for m in PRESET.finditer(path.read_text())]
    assert {name for name, _ in found} == set(PROFILE_PRESETS)
    for name, (max_tokens, temperature, top_p) in found:
        preset = PROFILE_PRESETS[name]
        assert (int(max_tokens), float(temperature), float(top_p)) == (preset.max_tokens, preset.temperature, preset.top_p), name
