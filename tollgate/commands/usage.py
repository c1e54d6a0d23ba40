"""`tollgate usage`: billed usage, ledger entries, and the reconciliation report.

A tenant API key sees its own tenant. `--tenant` and `--reconcile` speak with the
admin token when one is configured, which sees every tenant.
"""

from __future__ import annotations

import argparse
import itertools
from datetime import datetime
from typing import Any

from tollgate.client import AdminClient, Client
from tollgate.commands.connection import (
    CommandError,
    Connection,
    connection_flags,
    reports_errors,
    resolve,
)
from tollgate.commands.output import (
    entries_table,
    json_line,
    plain,
    reconciliation_text,
    usage_report,
)


def register(subparsers: Any) -> None:
    """Adds `usage` to the `tollgate` command line."""
    usage = subparsers.add_parser(
        "usage", parents=[connection_flags()], help="billed usage and ledger entries"
    )
    usage.add_argument("--tenant", default="", help="tenant id (default: the key's tenant)")
    usage.add_argument("--since", type=_iso_time, help="start, ISO 8601 (inclusive)")
    usage.add_argument("--until", type=_iso_time, help="end, ISO 8601 (exclusive)")
    usage.add_argument("--run", default="", help="with --entries: one run's entries")
    usage.add_argument("--limit", type=int, default=100, help="with --entries: at most N")
    mode = usage.add_mutually_exclusive_group()
    mode.add_argument("--entries", action="store_true", help="list ledger entries")
    mode.add_argument(
        "--reconcile", action="store_true", help="reconciliation report (exit 1 if not ok)"
    )
    usage.add_argument("--json", action="store_true")
    usage.set_defaults(func=usage_command)


def _iso_time(text: str) -> datetime:
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 time: {text!r}") from None


def _client(args: argparse.Namespace, connection: Connection) -> Client | AdminClient:
    wants_admin = bool(args.tenant) or args.reconcile
    # Only ledger calls are made, so the ledger's address is the client's only one.
    address, timeout, roots = connection.ledger_address(), connection.timeout, connection.tls_ca
    if wants_admin and connection.admin_token:
        return AdminClient(
            address, connection.admin_token, timeout=timeout, root_certificates=roots
        )
    if connection.api_key:
        return Client(address, connection.api_key, timeout=timeout, root_certificates=roots)
    if connection.admin_token:
        return AdminClient(
            address, connection.admin_token, timeout=timeout, root_certificates=roots
        )
    raise CommandError("no credentials: pass --api-key or --admin-token, or start the stack")


@reports_errors
def usage_command(args: argparse.Namespace) -> int:
    connection = resolve(args)
    with _client(args, connection) as client:
        if args.reconcile:
            report = client.get_reconciliation()
            print(json_line(plain(report)) if args.json else reconciliation_text(report))
            return 0 if report.ok else 1
        if args.entries:
            found = client.iter_ledger_entries(
                tenant_id=args.tenant, run_id=args.run, page_size=min(max(args.limit, 1), 500)
            )
            entries = list(itertools.islice(found, max(args.limit, 0)))
            if args.json:
                for entry in entries:
                    print(json_line(plain(entry)))
            else:
                print(entries_table(entries))
            return 0
        usage = client.get_usage(tenant_id=args.tenant, start=args.since, end=args.until)
        print(json_line(plain(usage)) if args.json else usage_report(usage))
        return 0
