"""`tollgate generate PROMPT` (or `--system/--user/--assistant` turns): stream a run's text."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from tollgate.commands.connection import (
    CommandError,
    connection_flags,
    model_flags,
    reports_errors,
    resolve,
    tenant_client,
)
from tollgate.commands.printing import print_stream
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
    connection = resolve(args)
    model = connection.require_model(args.model)
    with tenant_client(connection) as client:
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
            priority=args.priority,
            idempotency_key=args.idempotency_key,
            # Plain text is complete at the terminal event; billing comes after.
            until_terminal=args.until_terminal or not args.json,
        )
        return print_stream(stream, as_json=args.json)
