"""The `tollgate` command line: each area registers its own subcommands.

The client's commands (`tollgate.commands`) are registered at once. The operator's
(`services.commands`: `up`, `infra`, `reconcile`; `engine.commands`: `models`, `engine`) load
the server side (torch, SQLAlchemy, Kafka), so each stands as a placeholder that imports its
module only when that command is parsed; `tollgate --help` lists them from `OPERATOR_COMMANDS`.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tollgate import commands


@dataclass(frozen=True, slots=True)
class OperatorCommand:
    """A subcommand that `module`'s `register(subparsers)` adds, with the help it gives it."""

    name: str
    help: str
    module: str


OPERATOR_COMMANDS = (
    OperatorCommand(
        "infra", "local PostgreSQL and Kafka-protocol broker", "services.commands.infra"
    ),
    OperatorCommand(
        "up", "start PostgreSQL, the broker and the four services", "services.commands.up"
    ),
    OperatorCommand(
        "reconcile",
        "check every run's events and billing in the database (exit 1 if not ok)",
        "services.commands.reconcile",
    ),
    OperatorCommand("models", "create and inspect model directories", "engine.commands.models"),
    OperatorCommand("engine", "run the inference engine offline", "engine.commands.engine"),
)


class _CommandParser(argparse.ArgumentParser):
    """An ordinary parser, or with `deferred` the placeholder of an operator command."""

    def __init__(self, *, deferred: OperatorCommand | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._deferred = deferred

    # One signature for typeshed's three overloads, which differ only in the namespace's type.
    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> tuple[Any, list[str]]:
        if self._deferred is None:
            return super().parse_known_args(args, namespace)
        return registered(self._deferred).parse_known_args(args, namespace)


def registered(command: OperatorCommand) -> argparse.ArgumentParser:
    """The parser `command`'s module registers, as `tollgate <name>` (imports the module)."""
    parser = argparse.ArgumentParser(prog="tollgate")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    importlib.import_module(command.module).register(subparsers)
    return subparsers.choices[command.name]


def is_installed(command: OperatorCommand) -> bool:
    # Finding a top-level package imports nothing; a client-only install has none.
    return importlib.util.find_spec(command.module.partition(".")[0]) is not None


class _HelpFormatter(argparse.HelpFormatter):
    """Counts each subcommand's name at the indent it is shown at, which argparse leaves
    out, so that a name longer than eight letters keeps its help on its own line."""

    def add_argument(self, action: argparse.Action) -> None:
        super().add_argument(action)
        if action.help is argparse.SUPPRESS:
            return
        for subaction in self._iter_indented_subactions(action):
            length = len(self._format_action_invocation(subaction)) + self._current_indent
            self._action_max_length = max(self._action_max_length, length)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tollgate", description="Tollgate LLM serving gateway", formatter_class=_HelpFormatter
    )
    subparsers = parser.add_subparsers(
        dest="command", metavar="COMMAND", parser_class=_CommandParser
    )
    for command in OPERATOR_COMMANDS:
        if is_installed(command):
            subparsers.add_parser(command.name, help=command.help, deferred=command)
    commands.register(subparsers)
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
