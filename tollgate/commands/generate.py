"""`tollgate generate PROMPT` (or `--system/--user/--assistant` turns): stream a run's text.

`--json-schema`, `--json-object` and `--tools` shape the answer; `--logprobs N` reports
each token's log-probability after it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tollgate.commands.connection import (
    CommandError,
    connection_flags,
    model_flags,
    reports_errors,
    resolve,
    tenant_client,
)
from tollgate.commands.output import logprobs_table
from tollgate.commands.printing import print_stream
from tollgate.structure import TOOL_CHOICE_MODES
from tollgate.types import ChatMessage


def register(subparsers: Any) -> None:
    """Adds `generate` to the `tollgate` command line."""
    parser = subparsers.add_parser(
        "generate",
        parents=[connection_flags(), model_flags()],
        help="generate text for a prompt or chat turns, streamed as it is produced",
    )
    parser.add_argument("prompt", nargs="?", help="raw text to complete (or give chat turns)")
    turns = parser.add_argument_group("chat turns (the model's chat template is applied)")
    for role, text in TURN_FLAGS.items():
        turns.add_argument(
            f"--{role}", dest="messages", action=TurnAction, metavar="TEXT", help=text
        )
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    penalties = parser.add_argument_group("penalties and biases (OpenAI's and vLLM's)")
    penalties.add_argument("--frequency-penalty", type=float, metavar="F", help="-2 to 2")
    penalties.add_argument("--presence-penalty", type=float, metavar="P", help="-2 to 2")
    penalties.add_argument("--repetition-penalty", type=float, metavar="R", help="(0, 10]; 1 = off")
    penalties.add_argument("--min-p", type=float, metavar="P", help="0 to 1")
    penalties.add_argument(
        "--logit-bias",
        action="append",
        type=_bias,
        default=[],
        metavar="TOKEN=BIAS",
        help="add BIAS (-100 to 100) to token id TOKEN's logit (repeatable)",
    )
    structure = parser.add_argument_group("answer format, tools and logprobs (OpenAI's)")
    formats = structure.add_mutually_exclusive_group()
    formats.add_argument(
        "--json-schema",
        metavar="FILE",
        help="answer JSON valid against the schema in FILE (-: stdin)",
    )
    formats.add_argument("--json-object", action="store_true", help="answer one JSON object")
    structure.add_argument(
        "--tools", metavar="FILE", help="functions the model may call: a JSON list of OpenAI tools"
    )
    structure.add_argument(
        "--tool-choice",
        metavar="CHOICE",
        help="auto (the default), none, required, or the name of the one function to call",
    )
    structure.add_argument(
        "--no-parallel-tool-calls",
        dest="parallel_tool_calls",
        action="store_const",
        const=False,
        help="call at most one function",
    )
    structure.add_argument(
        "--logprobs",
        type=int,
        metavar="N",
        help="each token's log-probability and the N (0 to 20) likeliest in its place:"
        " in the events with --json, else a table on stderr",
    )
    parser.add_argument("--priority", choices=("interactive", "batch"), default="interactive")
    parser.add_argument("--idempotency-key", help="names the run; the same key attaches to it")
    parser.add_argument(
        "--json", action="store_true", help="one JSON object per event, up to `billed`"
    )
    parser.add_argument(
        "--until-terminal",
        action="store_true",
        help="with --json, stop at the terminal event instead of `billed`",
    )
    parser.set_defaults(func=generate_command)


def _bias(text: str) -> tuple[int, float]:
    token, _, bias = text.partition("=")
    try:
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not TOKEN=BIAS") from None


TURN_FLAGS = {
    "system": "the system message",
    "user": "a user turn (repeatable; turns keep their command-line order)",
    "assistant": "an earlier assistant turn (repeatable)",
}


class TurnAction(argparse.Action):
    """Appends (role, text) to `messages`, so that turns keep their command-line order."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        role = (option_string or "").removeprefix("--")
        turns = list(getattr(namespace, self.dest, None) or [])
        turns.append(ChatMessage(role=role, content=str(values)))
        setattr(namespace, self.dest, turns)


def prompt_or_messages(args: argparse.Namespace) -> tuple[str | None, list[ChatMessage] | None]:
    """The raw prompt or the chat turns: exactly one of them."""
    if args.prompt is not None and args.messages:
        raise CommandError("give a prompt or --system/--user/--assistant turns, not both")
    if args.prompt is None and not args.messages:
        raise CommandError("give a prompt or --system/--user/--assistant turns")
    return args.prompt, args.messages or None


@reports_errors
def generate_command(args: argparse.Namespace) -> int:
    prompt, messages = prompt_or_messages(args)
    response_format, tools = read_response_format(args), read_tools(args.tools)
    connection = resolve(args)
    model = connection.require_model(args.model)
    with tenant_client(connection) as client:
        try:
            stream = client.generate(
                prompt,
                messages=messages,
                model=model,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                top_k=args.top_k,
                top_p=args.top_p,
                seed=args.seed,
                stop=args.stop,
                frequency_penalty=args.frequency_penalty,
                presence_penalty=args.presence_penalty,
                repetition_penalty=args.repetition_penalty,
                min_p=args.min_p,
                logit_bias=dict(args.logit_bias),
                response_format=response_format,
                tools=tools,
                tool_choice=tool_choice_named(args.tool_choice),
                parallel_tool_calls=args.parallel_tool_calls,
                logprobs=args.logprobs is not None,
                top_logprobs=args.logprobs or 0,
                priority=args.priority,
                idempotency_key=args.idempotency_key,
                # Plain text is complete at the terminal event; billing comes after.
                until_terminal=args.until_terminal or not args.json,
            )
        except ValueError as exc:  # e.g. a --tools file of the wrong shape
            raise CommandError(str(exc)) from None
        code = print_stream(stream, as_json=args.json)
        if args.logprobs is not None and not args.json:
            print(logprobs_table(stream.logprobs), file=sys.stderr)
        return code


def read_response_format(args: argparse.Namespace) -> dict[str, Any] | None:
    """OpenAI's response_format for --json-schema FILE or --json-object; None for text."""
    if args.json_object:
        return {"type": "json_object"}
    if args.json_schema is None:
        return None
    schema = read_json("--json-schema", args.json_schema)
    if not isinstance(schema, dict | bool):
        raise CommandError(f"--json-schema {args.json_schema} is not a JSON schema (an object)")
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def read_tools(path: str | None) -> list[Any] | None:
    if path is None:
        return None
    found = read_json("--tools", path)
    if not isinstance(found, list):
        raise CommandError(f"--tools {path} is not a JSON list of tools")
    return found


def tool_choice_named(choice: str | None) -> str | dict[str, Any] | None:
    """A mode as it is; any other word names the one function to call."""
    if choice is None or choice in TOOL_CHOICE_MODES:
        return choice
    return {"type": "function", "function": {"name": choice}}


def read_json(flag: str, path: str) -> Any:
    """The JSON in the file `path` names (`-`: stdin)."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as exc:
        raise CommandError(f"cannot read {flag} {path}: {exc.strerror}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise CommandError(f"{flag} {path} is not JSON: {exc.msg}") from None
    except RecursionError:
        raise CommandError(f"{flag} {path} is JSON nested too deeply") from None
