"""`tollgate runs get | stream | cancel | list`."""

from __future__ import annotations

import argparse
import itertools
from typing import Any

from tollgate.client import Client
from tollgate.commands.connection import connection_flags, reports_errors, resolve, tenant_client
from tollgate.commands.output import json_line, key_values, plain, run_fields, runs_table
from tollgate.commands.printing import print_stream


def register(subparsers: Any) -> None:
    """Adds `runs ...` to the `tollgate` command line."""
    flags = connection_flags()
    runs = subparsers.add_parser("runs", help="inspect, follow and cancel runs")
    commands = runs.add_subparsers(dest="runs_command", metavar="COMMAND", required=True)

    get = commands.add_parser("get", parents=[flags], help="a run's state and usage")
    get.add_argument("run_id")
    get.add_argument("--json", action="store_true")
    get.set_defaults(func=get_command)

    stream = commands.add_parser("stream", parents=[flags], help="follow a run's events")
    stream.add_argument("run_id")
    stream.add_argument("--after", type=int, default=0, metavar="SEQ", help="events after SEQ")
    stream.add_argument("--json", action="store_true", help="one JSON object per event")
    stream.add_argument("--until-terminal", action="store_true", help="stop before `billed`")
    stream.set_defaults(func=stream_command)

    cancel = commands.add_parser("cancel", parents=[flags], help="cancel a run")
    cancel.add_argument("run_id")
    cancel.add_argument("--json", action="store_true")
    cancel.set_defaults(func=cancel_command)

    listing = commands.add_parser("list", parents=[flags], help="the tenant's runs")
    listing.add_argument("--limit", type=int, default=20, help="at most N runs (default: 20)")
    listing.add_argument("--json", action="store_true", help="one JSON object per run")
    listing.set_defaults(func=list_command)


def _client(args: argparse.Namespace) -> Client:
    return tenant_client(resolve(args))


@reports_errors
def get_command(args: argparse.Namespace) -> int:
    with _client(args) as client:
        run = client.get_run(args.run_id)
    print(json_line(plain(run)) if args.json else key_values(run_fields(run)))
    return 0


@reports_errors
def stream_command(args: argparse.Namespace) -> int:
    with _client(args) as client:
        stream = client.stream_run(
            args.run_id, starting_after=args.after, until_terminal=args.until_terminal
        )
        return print_stream(stream, as_json=args.json)


@reports_errors
def cancel_command(args: argparse.Namespace) -> int:
    with _client(args) as client:
        run = client.cancel_run(args.run_id)
    print(json_line(plain(run)) if args.json else f"run {run.run_id}: {run.state}")
    return 0


@reports_errors
def list_command(args: argparse.Namespace) -> int:
    limit = max(args.limit, 0)
    with _client(args) as client:
        runs = list(itertools.islice(client.iter_runs(page_size=min(limit, 100) or 1), limit))
    if args.json:
        for run in runs:
            print(json_line(plain(run)))
    else:
        print(runs_table(runs))
    return 0
