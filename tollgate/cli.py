"""The `tollgate` command line: each area registers its own subcommands."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Modules that expose `register(subparsers)`; each adds its own subcommands
# and sets `func` on its parsers.
COMMAND_MODULES = (
    "services.stack.infra_cli",
    "services.stack.cli",
    "engine.tools.cli",
    "tollgate.commands",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tollgate", description="Tollgate LLM serving gateway")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
