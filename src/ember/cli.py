"""``ember``: serve | chat | bench | route.

Each subcommand lives with its feature and registers itself here through a
``register(subparsers)`` function that sets ``func`` on its parser.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ember", description="Low-latency LLM chat serving.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{serve,chat,bench,route}")
    import importlib

    # Each feature registers its own subcommand; a missing one must not break the rest.
    for module in ("ember.server.cli", "ember.chat", "ember.bench.cli", "ember.router.cli"):
        try:
            importlib.import_module(module).register(sub)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = args.func(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
