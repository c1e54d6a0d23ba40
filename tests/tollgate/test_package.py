"""What a client installs: the SDK stands alone, without the server side."""

import argparse
import importlib
import json
import subprocess
import sys

import pytest

from tollgate.cli import OPERATOR_COMMANDS, OperatorCommand, build_parser

HEAVY = ("services", "engine", "torch", "sqlalchemy", "psycopg", "aiokafka")

CHECK = """
import sys
import tollgate
from tollgate import AsyncClient, Client, RunEvent, TollgateError
import tollgate.commands
loaded = sorted(m for m in sys.modules if m.split('.')[0] in {heavy!r})
print(loaded)
"""

# Parses argv with the real command line, then reports which heavy modules it loaded.
PARSE = """
import json, sys
from tollgate.cli import build_parser
try:
    build_parser().parse_args(sys.argv[1:])
except SystemExit:
    pass
heavy = {heavy!r}
print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in heavy)))
"""


def parse_in_fresh_python(*argv: str) -> tuple[str, list[str]]:
    """The command line's output for `tollgate <argv>`, and the heavy modules it imported."""
    script = PARSE.format(heavy=HEAVY)
    result = subprocess.run(
        [sys.executable, "-c", script, *argv],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    *output, loaded = result.stdout.splitlines()
    return "\n".join(output), json.loads(loaded)


def test_the_sdk_and_client_commands_import_no_server_code() -> None:
    result = subprocess.run(
        [sys.executable, "-c", CHECK.format(heavy=HEAVY)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert result.stdout.strip() == "[]"


def test_help_lists_the_operator_commands_without_loading_them() -> None:
    output, loaded = parse_in_fresh_python("--help")
    assert loaded == []
    for command in OPERATOR_COMMANDS:
        assert f"    {command.name} " in output
    assert "    runs " in output


@pytest.mark.parametrize(
    "argv",
    [
        ("runs", "list"),
        ("runs", "list", "--help"),
        ("generate", "Hi", "--model", "tiny"),
        ("generate", "--system", "Be brief.", "--user", "Hi", "--model", "tiny"),
        ("chat", "--model", "tiny"),
        ("chat", "--help"),
    ],
)
def test_client_commands_load_no_server_code(argv: tuple[str, ...]) -> None:
    _, loaded = parse_in_fresh_python(*argv)
    assert loaded == []


def test_an_operator_command_shows_its_real_options() -> None:
    output, loaded = parse_in_fresh_python("up", "--help")
    assert output.startswith("usage: tollgate up ")
    assert "--kv-blocks" in output and "--data-dir" in output
    assert "services" in loaded


def test_an_operator_command_parses_to_its_own_function() -> None:
    args = build_parser().parse_args(["infra", "up", "--data-dir", "/tmp/x"])
    assert (args.command, args.infra_command, str(args.data_dir)) == ("infra", "up", "/tmp/x")
    assert args.func.__module__ == "services.commands.infra"


@pytest.mark.parametrize("command", OPERATOR_COMMANDS, ids=lambda c: c.name)
def test_the_table_says_what_the_module_registers(command: OperatorCommand) -> None:
    parser = argparse.ArgumentParser(prog="tollgate")
    importlib.import_module(command.module).register(parser.add_subparsers())
    listed = " ".join(parser.format_help().split())
    assert f"{command.name} {command.help}" in listed
