"""`tollgate reconcile`: the invariant report, read from the database itself.

Exits 1 when any invariant is broken, 0 otherwise; 2 when it cannot tell (no database).
The database is the one `--database-url` names, else the one in `--data-dir`'s
stack.json (`tollgate up`), else TOLLGATE_DATABASE_URL, else the default stack's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from services.core.db import open_db
from services.ledger.reconcile import DEFAULT_STUCK_AFTER_SECONDS, InvariantReport, Scope, check

# As `tollgate up` writes it (services/commands/up.py).
DEFAULT_DATA_DIR = Path(".tollgate/stack")
STACK_FILE = "stack.json"
# The ledger sweep's default grace: a run terminal for longer is overdue for billing.
UNBILLED_GRACE_SECONDS = 10.0
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
NOT_CHECKED = "worker pools free when idle: not checked (workers keep their pools in memory)"


def register(subparsers: Any) -> None:
    command = subparsers.add_parser(
        "reconcile", help="check every run's events and billing in the database (exit 1 if not ok)"
    )
    source = command.add_mutually_exclusive_group()
    source.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help=f"a stack's directory (default: {DEFAULT_DATA_DIR})",
    )
    source.add_argument("--database-url", default=None, help="the database to check")
    command.add_argument("--json", action="store_true", help="one JSON object")
    command.add_argument(
        "--since",
        type=duration,
        default=None,
        help="only runs created this long ago or later (30m, 2h, 1d)",
    )
    command.add_argument(
        "--stuck-after",
        type=duration,
        default=DEFAULT_STUCK_AFTER_SECONDS,
        help="a run not ended this long after its creation is stuck (default: 10m)",
    )
    command.set_defaults(func=reconcile_command)


def duration(text: str) -> float:
    """Seconds from `90`, `90s`, `30m`, `2h` or `1d`."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd]?)", text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 90s, 30m, 2h, 1d)")
    return float(match[1]) * _UNITS[match[2] or "s"]


def database_url(args: argparse.Namespace) -> str | None:
    """The flag's, else (no --data-dir) TOLLGATE_DATABASE_URL, else stack.json's."""
    if args.database_url:
        return str(args.database_url)
    if args.data_dir is None and os.environ.get("TOLLGATE_DATABASE_URL"):
        return os.environ["TOLLGATE_DATABASE_URL"]
    stack = (args.data_dir or DEFAULT_DATA_DIR) / STACK_FILE
    return str(json.loads(stack.read_text())["database_url"]) if stack.is_file() else None


def reconcile_command(args: argparse.Namespace) -> int:
    url = database_url(args)
    if not url:
        print("no database: give --database-url or a --data-dir with stack.json", file=sys.stderr)
        return 2
    report = asyncio.run(_check(url, args.since, args.stuck_after))
    print(report_json(report) if args.json else report_text(report))
    return 0 if report.ok else 1


async def _check(url: str, since: float | None, stuck_after: float) -> InvariantReport:
    db = open_db(url, pool_size=2)
    try:
        return await check(
            db,
            Scope(since_seconds=since),
            unbilled_grace=UNBILLED_GRACE_SECONDS,
            stuck_after=stuck_after,
        )
    finally:
        await db.dispose()


def report_json(report: InvariantReport) -> str:
    return json.dumps({"ok": report.ok, "broken": report.broken(), "not_checked": [NOT_CHECKED]})


def report_text(report: InvariantReport) -> str:
    broken = report.broken()
    lines = ["ok: every invariant holds" if report.ok else "NOT OK"]
    for name, run_ids in broken.items():
        lines.append(f"{name}: {len(run_ids)} run(s)")
        lines.extend(f"  {run_id}" for run_id in run_ids)
    lines.append(NOT_CHECKED)
    return "\n".join(lines)
