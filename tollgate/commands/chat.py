"""`tollgate chat`: a conversation with the stack's model in the terminal.

Each line read is a user turn; the whole conversation so far goes out as `messages`,
and the reply streams back and joins it. EOF or `/exit` ends the chat.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any, TextIO

from tollgate.client import Client
from tollgate.commands.connection import (
    connection_flags,
    model_flags,
    reports_errors,
    resolve,
    tenant_client,
)
from tollgate.commands.printing import print_stream
from tollgate.errors import TollgateError
from tollgate.types import ChatMessage

PROMPT = "you> "
EXIT = "/exit"


@dataclass(frozen=True, slots=True)
class ChatSettings:
    model: str
    max_tokens: int
    temperature: float | None


def register(subparsers: Any) -> None:
    """Adds `chat` to the `tollgate` command line."""
    parser = subparsers.add_parser(
        "chat",
        parents=[connection_flags(), model_flags()],
        help="chat with the stack's model in the terminal (EOF or /exit ends it)",
    )
    parser.add_argument("--system", metavar="TEXT", help="the system message")
    parser.set_defaults(func=chat_command)


@reports_errors
def chat_command(args: argparse.Namespace) -> int:
    connection = resolve(args)
    settings = ChatSettings(connection.require_model(args.model), args.max_tokens, args.temperature)
    conversation = [ChatMessage("system", args.system)] if args.system else []
    with tenant_client(connection) as client:
        converse(client, settings, conversation)
    return 0


def converse(client: Client, settings: ChatSettings, conversation: list[ChatMessage]) -> None:
    """Reads turns and streams replies until EOF, `/exit` or Ctrl-C at the prompt."""
    while (line := read_turn(sys.stdin, sys.stdout)) is not None:
        if not line:
            continue
        turns = [*conversation, ChatMessage("user", line)]
        answer = reply(client, settings, turns, sys.stdout)
        if answer is not None:
            conversation[:] = [*turns, ChatMessage("assistant", answer)]


def read_turn(stdin: TextIO, stdout: TextIO) -> str | None:
    """The next line without its newline; None at EOF, `/exit` or Ctrl-C."""
    try:
        if stdin.isatty():
            line = input(PROMPT)
        else:
            line = stdin.readline()
            if not line:
                return None
    except EOFError:
        return None
    except KeyboardInterrupt:
        stdout.write("\n")
        return None
    line = line.rstrip("\r\n")
    return None if line.strip() == EXIT else line


def reply(
    client: Client, settings: ChatSettings, turns: list[ChatMessage], out: TextIO
) -> str | None:
    """Streams the model's reply to `turns`; None when it failed or was cancelled (Ctrl-C)."""
    stream = client.generate(
        messages=turns,
        model=settings.model,
        max_tokens=settings.max_tokens,
        temperature=settings.temperature,
        until_terminal=True,
    )
    try:
        print_stream(stream, as_json=False, out=out)
    except KeyboardInterrupt:
        out.write("\n")
        if stream.run_id is not None:
            cancel(client, stream.run_id)
        return None
    except TollgateError as exc:
        print(f"error: {exc.summary()}", file=sys.stderr)
        return None
    return stream.text


def cancel(client: Client, run_id: str) -> None:
    try:
        client.cancel_run(run_id)
    except TollgateError as exc:
        print(f"error: {exc.summary()}", file=sys.stderr)
