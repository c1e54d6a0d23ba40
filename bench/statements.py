"""`python -m bench.statements --stack .tollgate/stack/stack.json`: the statements each
service sends PostgreSQL per run, on a running local stack (`tollgate up`, whose
PostgreSQL logs to `infra/postgres.log` beside the stack file).

Runs one warm-up run, turns on the server's statement log (`log_statement = all`, each
line prefixed with the connection's application name, which the launcher sets to the
service's process name), streams `--runs` runs one after another, turns the log off again
and counts what it holds. Prints statements per run by service, then the commonest
statements, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import psycopg

from bench.report import progress
from services.core.db import libpq_url
from tollgate import Client

PREFIX = "%a|"
# Each logged statement's first line: `<application>|LOG:  statement: …` or `… execute …: …`.
LOGGED = re.compile(r"^(?P<app>[^|\s]*)\|LOG:\s+(?:statement|execute [^:]*):\s*(?P<sql>.*)$")


def set_logging(database_url: str, on: bool) -> None:
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        conn.execute(f"ALTER SYSTEM SET log_statement = '{'all' if on else 'none'}'")
        conn.execute(f"ALTER SYSTEM SET log_line_prefix = '{PREFIX}'")
        conn.execute("SELECT pg_reload_conf()")


def count(lines: Sequence[str], runs: int) -> tuple[Counter[str], Counter[tuple[str, str]]]:
    by_app: Counter[str] = Counter()
    by_statement: Counter[tuple[str, str]] = Counter()
    for i, line in enumerate(lines):
        logged = LOGGED.match(line)
        if logged is None:
            continue
        app = logged["app"] or "?"
        # A statement that starts with a line break goes on in the lines that follow.
        text = logged["sql"] or " ".join(lines[i + 1 : i + 4])
        sql = " ".join(text.split())[:70]
        if "pg_reload_conf" in sql or "ALTER SYSTEM" in sql:
            continue
        by_app[app] += 1
        by_statement[(app, sql)] += 1
    return by_app, by_statement


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.statements", description=__doc__)
    parser.add_argument("--stack", type=Path, default=Path(".tollgate/stack/stack.json"))
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    stack = json.loads(args.stack.read_text())
    log_path = args.stack.parent / "infra" / "postgres.log"
    client = Client(stack["gateway"], stack["api_key"])
    model = client.list_models()[0].name

    def one() -> None:
        for _event in client.generate(
            model=model, prompt="count to ten", max_tokens=args.max_tokens, ignore_eos=True
        ):
            pass

    one()
    time.sleep(2)
    with open(log_path, errors="replace") as log:
        start = sum(1 for _ in log)
    set_logging(stack["database_url"], True)
    try:
        time.sleep(1)
        progress(f"{args.runs} runs of {args.max_tokens} tokens, one after another")
        for _ in range(args.runs):
            one()
        time.sleep(6)  # the billing, and the timers that follow a run
    finally:
        set_logging(stack["database_url"], False)
    with open(log_path, errors="replace") as log:
        lines = log.read().splitlines()[start:]
    by_app, by_statement = count(lines, args.runs)
    for app, n in by_app.most_common():
        print(f"{app:28s} {n / args.runs:6.1f} per run")
    for (app, sql), n in by_statement.most_common(25):
        print(f"{n / args.runs:6.1f}  {app:24s} {sql}")
    per_run = {app: round(n / args.runs, 1) for app, n in by_app.most_common()}
    print(json.dumps({"runs": args.runs, "max_tokens": args.max_tokens, "per_run": per_run}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
