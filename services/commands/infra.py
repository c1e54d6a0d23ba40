"""`tollgate infra up`: PostgreSQL and the Kafka broker alone, without the services."""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import threading
from pathlib import Path
from typing import Any

import structlog

from services.core.telemetry import configure_logging
from services.stack.infra import LocalInfra, without_password, write_private
from services.stack.server_process import InfraError

DEFAULT_DATA_DIR = Path(".tollgate/infra")
ENDPOINTS_FILE = "infra.json"

log = structlog.get_logger(__name__)


def register(subparsers: Any) -> None:
    """Adds `infra up` to the `tollgate` command line."""
    infra = subparsers.add_parser("infra", help="local PostgreSQL and Kafka-protocol broker")
    commands = infra.add_subparsers(dest="infra_command", metavar="COMMAND", required=True)
    up = commands.add_parser(
        "up", help="start them, print their endpoints, stop them on SIGINT/SIGTERM"
    )
    up.add_argument(
        "--data-dir", type=Path, default=DEFAULT_DATA_DIR, help=f"default: {DEFAULT_DATA_DIR}"
    )
    up.set_defaults(func=up_command)


def up_command(args: argparse.Namespace) -> int:
    """Runs until SIGINT or SIGTERM; stdout carries only the endpoints JSON line, the
    database's password hidden: the endpoints file, readable by its owner alone, has it."""
    configure_logging("infra")
    stopping = threading.Event()
    # Installed before starting, so a signal during start-up still ends in a clean stop.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stopping.set())
    data_dir: Path = args.data_dir
    try:
        with LocalInfra(data_dir) as endpoints:
            described = dataclasses.asdict(endpoints)
            write_private(data_dir / ENDPOINTS_FILE, json.dumps(described) + "\n")
            described["database_url"] = without_password(endpoints.database_url)
            print(json.dumps(described), flush=True)
            stopping.wait()
    except InfraError as exc:
        log.error("infra failed", error=str(exc))
        return 1
    return 0
