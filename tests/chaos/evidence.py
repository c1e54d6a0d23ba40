"""What the chaos checks read from outside the services: the database, the topic and the
workers' own status."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Collection, Iterable
from typing import Any, TypeVar

import grpc
import psycopg

from services.core.db import libpq_url
from services.core.runs import ENDED_STATES
from tests.chaos.cluster import INTERNAL_TOKEN
from tests.services.core.kafka_tools import read_topic
from tollgate.v1 import events_pb2, worker_pb2, worker_pb2_grpc

T = TypeVar("T")
_ENDED = [str(state) for state in ENDED_STATES]
DB_RETRY_S = 60.0


def _with_db(database_url: str, read: Callable[[psycopg.Cursor[Any]], T]) -> T:
    """`read` on a fresh connection, tried again while PostgreSQL is away (being restarted)."""
    deadline = time.monotonic() + DB_RETRY_S
    while True:
        try:
            with psycopg.connect(libpq_url(database_url), connect_timeout=3) as conn:
                with conn.cursor() as cursor:
                    return read(cursor)
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


def held_runs(database_url: str, worker_pid: int, max_seq: int | None = None) -> tuple[str, ...]:
    """Runs leased to the worker process `worker_pid` and not ended (ids name their pid);
    with `max_seq`, those that have stored no more events than that."""

    def read(cursor: psycopg.Cursor[Any]) -> tuple[str, ...]:
        cursor.execute(
            "SELECT run_id FROM runs WHERE owner LIKE %s AND state <> ALL(%s) AND last_seq <= %s",
            (f"%-{worker_pid}-%", _ENDED, max_seq if max_seq is not None else 2**62),
        )
        return tuple(row[0] for row in cursor.fetchall())

    return _with_db(database_url, read)


def settled_after(database_url: str, run_ids: Collection[str], at: float) -> dict[str, float]:
    """For each run re-queued or failed after `at` (a time.time()): how many seconds after
    `at` the first such event was written."""
    if not run_ids:
        return {}

    def read(cursor: psycopg.Cursor[Any]) -> dict[str, float]:
        cursor.execute(
            "SELECT run_id, min(created_at) FROM run_events"
            " WHERE run_id = ANY(%s) AND created_at >= to_timestamp(%s)"
            " AND kind IN ('queued', 'failed') GROUP BY run_id",
            (list(run_ids), at),
        )
        return {run_id: created.timestamp() - at for run_id, created in cursor.fetchall()}

    return _with_db(database_url, read)


def stored_events(
    database_url: str, run_ids: Collection[str]
) -> dict[str, list[tuple[int, str, list[int]]]]:
    """Each run's stored events as (seq, kind, token_ids), in seq order."""

    def read(cursor: psycopg.Cursor[Any]) -> dict[str, list[tuple[int, str, list[int]]]]:
        cursor.execute(
            "SELECT run_id, seq, kind, payload::text FROM run_events"
            " WHERE run_id = ANY(%s) ORDER BY run_id, seq",
            (list(run_ids),),
        )
        stored: dict[str, list[tuple[int, str, list[int]]]] = {}
        for run_id, seq, kind, payload in cursor.fetchall():
            tokens = json.loads(payload).get("token_ids", []) if kind == "streaming" else []
            stored.setdefault(run_id, []).append((int(seq), kind, list(tokens)))
        return stored

    return _with_db(database_url, read)


def published(bootstrap: str, topic: str, num_expected: int) -> set[tuple[str, int]]:
    """(run_id, seq) of every event on the topic."""
    records = asyncio.run(read_topic(bootstrap, topic, min_records=num_expected, timeout=30))
    seen = set()
    for record in records:
        event = events_pb2.RunEvent.FromString(record.value)
        seen.add((event.run_id, int(event.seq)))
    return seen


def busy_workers(addresses: Iterable[str]) -> dict[str, str]:
    """Workers whose pool is not all free or that still run something, with their status."""
    busy = {}
    for address in addresses:
        with grpc.insecure_channel(address) as channel:
            status = worker_pb2_grpc.WorkerServiceStub(channel).GetWorkerStatus(
                worker_pb2.GetWorkerStatusRequest(),
                timeout=5,
                metadata=(("authorization", f"Bearer {INTERNAL_TOKEN}"),),
            )
        if status.num_free_blocks != status.num_total_blocks or status.running_run_ids:
            busy[address] = (
                f"{status.num_free_blocks}/{status.num_total_blocks} blocks free,"
                f" running {list(status.running_run_ids)}"
            )
    return busy
