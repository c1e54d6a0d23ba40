"""PostgreSQL event store: append with optimistic concurrency, read, leases.

An append runs in one transaction: it locks the run's projection row, checks
the expected seq and the lease epoch, folds the new events through the state
machine (services.core.runs), writes the events, the projection and the outbox
rows, and sends a notice on EVENTS_CHANNEL, delivered when it commits.  Any
failure raises and writes nothing.  Appends to many runs at once (a worker's
step) take the same few statements as an append to one.

The notice reads `<run_id> <json>` and carries the appended events themselves
(`parse_notice`), or only `<run_id>` when they would not fit in a notification.
It wakes the outbox relay, and lets admission stream a run's events without
reading them back.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from psycopg import AsyncCursor
from psycopg.types.json import Jsonb
from sqlalchemy.ext.asyncio import AsyncConnection

from services.core.db import EVENTS_CHANNEL, Database, driver_cursor, single_statement
from services.core.runs import (
    EventStoreError,
    NewEvent,
    NewRun,
    RunState,
    RunView,
    StoredEvent,
    apply_events,
)
from services.core.schema import run_events, runs


class ConcurrencyConflict(EventStoreError):
    def __init__(self, run_id: str, expected_seq: int, actual_seq: int | None) -> None:
        super().__init__(f"run {run_id}: expected last seq {expected_seq}, found {actual_seq}")
        self.run_id = run_id
        self.expected_seq = expected_seq
        self.actual_seq = actual_seq


class StaleLease(EventStoreError):
    def __init__(self, run_id: str, lease_epoch: int, current_epoch: int) -> None:
        super().__init__(f"run {run_id}: lease epoch {lease_epoch} is stale (now {current_epoch})")
        self.run_id = run_id
        self.lease_epoch = lease_epoch
        self.current_epoch = current_epoch


class RunNotFound(EventStoreError):
    def __init__(self, run_id: str) -> None:
        super().__init__(f"run {run_id} does not exist")
        self.run_id = run_id


class IdempotencyKeyTaken(EventStoreError):
    def __init__(self, run_id: str, existing_run_id: str) -> None:
        super().__init__(f"run {run_id}: idempotency key already names run {existing_run_id}")
        self.run_id = run_id
        self.existing_run_id = existing_run_id


@dataclass(frozen=True, slots=True)
class Append:
    """Events for one run, appended after `expected_seq` (0 for a new run)."""

    run_id: str
    expected_seq: int
    events: Sequence[NewEvent]
    new_run: NewRun | None = None
    lease_epoch: int | None = None
    traceparent: str = ""
    # The run's projection row as the caller's transaction read it, locked (`FOR UPDATE`):
    # the append then takes no lock of its own.
    locked: RunView | None = None


async def append_in(conn: AsyncConnection, append: Append) -> list[StoredEvent]:
    """Appends inside the caller's transaction, so other effects commit with it."""
    return await append_all_in(conn, [append])


async def append_all_in(conn: AsyncConnection, appends: Sequence[Append]) -> list[StoredEvent]:
    """Appends to several runs inside the caller's transaction, each run's events in seq order.

    Existing runs take two statements together, whatever their number: lock all (in run
    id order, so two such appends cannot deadlock each other; but those whose row the
    caller locked already), then update all and insert all events. A new run adds one
    statement. The first refused append raises, and the
    caller's transaction then writes nothing.
    """
    if not appends or any(not append.events for append in appends):
        raise ValueError("an append needs at least one event")
    if len({append.run_id for append in appends}) != len(appends):
        raise ValueError("one append per run")
    async with driver_cursor(conn) as cursor:
        views = {}
        for append in appends:
            if append.expected_seq == 0:
                views[append.run_id] = await _insert_run(cursor, append)
        existing = [append for append in appends if append.expected_seq != 0]
        updated: list[RunView] = []
        if existing:
            to_lock = [append for append in existing if append.locked is None]
            locked = await _lock_runs(cursor, to_lock) if to_lock else {}
            for append in existing:
                if append.locked is not None:
                    locked[append.run_id] = _checked(append, append.locked)
            updated = [apply_events(locked[a.run_id], a.events) for a in existing]
            views.update((view.run_id, view) for view in updated)
        return await _insert_events(cursor, [(views[a.run_id], a) for a in appends], updated)


_INSERT_RUN = """
    INSERT INTO runs (run_id, tenant_id, model, priority, state, last_seq, lease_epoch,
                      idempotency_key, request_hash, finish_reason, usage)
    VALUES (%(run_id)s, %(tenant_id)s, %(model)s, %(priority)s, %(state)s, %(last_seq)s, 0,
            %(idempotency_key)s, %(request_hash)s, %(finish_reason)s, %(usage)s)
    ON CONFLICT DO NOTHING
    RETURNING run_id
"""


async def _insert_run(cursor: AsyncCursor[dict[str, Any]], append: Append) -> RunView:
    if append.new_run is None:
        raise ValueError("the first append of a run needs new_run")
    view = apply_events(RunView.new(append.run_id, append.new_run), append.events)
    projection = _projection(view)
    await cursor.execute(_INSERT_RUN, {**projection, "usage": Jsonb(projection["usage"]),
                                       "model": view.model,
                                       "tenant_id": view.tenant_id, "priority": view.priority,
                                       "idempotency_key": view.idempotency_key,
                                       "request_hash": view.request_hash})  # fmt: skip
    if await cursor.fetchone() is None:
        await _raise_insert_conflict(cursor, append)
    return view


async def _raise_insert_conflict(cursor: AsyncCursor[dict[str, Any]], append: Append) -> None:
    await cursor.execute("SELECT last_seq FROM runs WHERE run_id = %s", (append.run_id,))
    existing = await cursor.fetchone()
    if existing is not None:
        raise ConcurrencyConflict(append.run_id, 0, existing["last_seq"])
    assert append.new_run is not None
    await cursor.execute(
        "SELECT run_id FROM runs WHERE tenant_id = %s AND idempotency_key = %s",
        (append.new_run.tenant_id, append.new_run.idempotency_key),
    )
    other = await cursor.fetchone()
    raise IdempotencyKeyTaken(append.run_id, str(other["run_id"] if other else ""))


async def _lock_runs(
    cursor: AsyncCursor[dict[str, Any]], appends: Sequence[Append]
) -> dict[str, RunView]:
    """Locks the runs' projection rows and checks each append against its row."""
    await cursor.execute(
        "SELECT * FROM runs WHERE run_id = ANY(%s) ORDER BY run_id FOR UPDATE",
        ([append.run_id for append in appends],),
    )
    views = {row["run_id"]: view_from_row(row) for row in await cursor.fetchall()}
    for append in appends:
        view = views.get(append.run_id)
        if view is None:
            raise RunNotFound(append.run_id)
        _checked(append, view)
    return views


def _checked(append: Append, view: RunView) -> RunView:
    """`view`, the run's locked row, once `append` is checked against it."""
    if view.last_seq != append.expected_seq:
        raise ConcurrencyConflict(append.run_id, append.expected_seq, view.last_seq)
    if append.lease_epoch is not None and append.lease_epoch != view.lease_epoch:
        raise StaleLease(append.run_id, append.lease_epoch, view.lease_epoch)
    return view


# The projection rows of runs that existed, as their appended events leave them.
_UPDATE_RUNS = """
    UPDATE runs SET state = v.state, last_seq = v.last_seq, usage = v.usage::jsonb,
                    finish_reason = v.finish_reason, updated_at = clock_timestamp()
    FROM json_to_recordset(%(runs)s::json)
         AS v(run_id text, state text, last_seq bigint, usage json, finish_reason text)
    WHERE runs.run_id = v.run_id
"""


def _projection(view: RunView) -> dict[str, Any]:
    """The columns an append changes."""
    return {
        "run_id": view.run_id,
        "state": str(view.state),
        "last_seq": view.last_seq,
        "usage": dict(view.usage),
        "finish_reason": view.finish_reason,
    }


# PostgreSQL refuses notification payloads of 8000 bytes or more.
NOTICE_MAX_BYTES = 7999

# One round trip for any number of events of any number of runs: the events, their
# outbox rows and one notice per run; and with `_UPDATE_RUNS` ahead of them, the
# projection rows of the runs that existed. Only what the caller does not hold comes
# back: each event's `created_at`.
#
# The payloads travel inside the one JSON document of the rows, encoded once. PostgreSQL
# unescapes every string of a document it takes apart, and U+0000 (which generated text
# may hold) does not survive that: a document with one carries each payload as a JSON
# string instead, which is stored as it was escaped (`_ESCAPED`).
_EVENTS = """
    ev AS (
        INSERT INTO run_events (run_id, seq, kind, tenant_id, payload, traceparent)
        SELECT t.run_id, t.seq, t.kind, t.tenant_id, t.payload::json, t.traceparent
        FROM json_to_recordset(%(rows)s::json)
             AS t(run_id text, seq bigint, kind text, tenant_id text, payload {payload_type},
                  traceparent text)
        RETURNING run_id, seq, kind, tenant_id, payload, traceparent, created_at
    ), ob AS (
        INSERT INTO outbox (run_id, seq) SELECT run_id, seq FROM ev ORDER BY run_id, seq
    ), notice AS (
        SELECT run_id, run_id || ' ' || json_build_object(
            'tenant_id', tenant_id,
            'traceparent', traceparent,
            'events', json_agg(json_build_object(
                'seq', seq, 'kind', kind, 'payload', payload, 'created_at', created_at
            ) ORDER BY seq)
        )::text AS text
        FROM ev GROUP BY run_id, tenant_id, traceparent
    ), notified AS (
        SELECT run_id, pg_notify(
            %(channel)s,
            CASE WHEN octet_length(text) <= %(notice_max)s THEN text ELSE run_id END
        ) FROM notice
    )
    SELECT ev.run_id, ev.seq, ev.created_at FROM ev JOIN notified USING (run_id)
"""
_ESCAPED = "\\u0000"
# By (whether runs existed, whether the payloads are escaped): the statement.
_STATEMENTS = {
    (updated, escaped): (f"WITH updated AS ({_UPDATE_RUNS}), " if updated else "WITH ")
    + _EVENTS.replace("{payload_type}", "text" if escaped else "json")
    for updated in (False, True)
    for escaped in (False, True)
}


async def _insert_events(
    cursor: AsyncCursor[dict[str, Any]],
    appends: Sequence[tuple[RunView, Append]],
    updated: Sequence[RunView],
) -> list[StoredEvent]:
    """Inserts the events of `appends` and writes the projection rows of `updated`; the
    appended events, in the order of `appends` and then of seq."""
    rows: list[dict[str, Any]] = [
        {"run_id": view.run_id, "seq": append.expected_seq + n, "kind": event.kind,
         "tenant_id": view.tenant_id, "payload": event.payload,
         "traceparent": append.traceparent}
        for view, append in appends
        for n, event in enumerate(append.events, start=1)
    ]  # fmt: skip
    document = json.dumps(rows, default=dict)
    escaped = _ESCAPED in document
    if escaped:
        document = json.dumps([{**row, "payload": json.dumps(row["payload"], default=dict)}
                               for row in rows])  # fmt: skip
    await cursor.execute(
        _STATEMENTS[bool(updated), escaped],
        {
            "rows": document,
            "runs": json.dumps([_projection(view) for view in updated]),
            "channel": EVENTS_CHANNEL,
            "notice_max": NOTICE_MAX_BYTES,
        },
    )
    created = {(row["run_id"], row["seq"]): row["created_at"] for row in await cursor.fetchall()}
    return [
        StoredEvent(run_id=row["run_id"], seq=row["seq"], kind=row["kind"],
                    tenant_id=row["tenant_id"], payload=row["payload"],
                    created_at=created[row["run_id"], row["seq"]],
                    traceparent=row["traceparent"])
        for row in rows
    ]  # fmt: skip


def parse_notice(notice: str) -> tuple[str, list[StoredEvent] | None]:
    """The run id of an append's notice, and its events (None when they did not fit)."""
    run_id, _, body = notice.partition(" ")
    if not body:
        return run_id, None
    append = json.loads(body)
    return run_id, [
        event_from_row(
            {
                **event,
                "run_id": run_id,
                "tenant_id": append["tenant_id"],
                "traceparent": append["traceparent"],
                "created_at": datetime.fromisoformat(event["created_at"]),
            }
        )
        for event in append["events"]
    ]


def view_from_row(row: Mapping[Any, Any]) -> RunView:
    return RunView(
        run_id=row["run_id"],
        tenant_id=row["tenant_id"],
        model=row["model"],
        priority=row["priority"],
        state=RunState(row["state"]),
        last_seq=row["last_seq"],
        lease_epoch=row["lease_epoch"],
        owner=row["owner"],
        idempotency_key=row["idempotency_key"],
        request_hash=row["request_hash"],
        finish_reason=row["finish_reason"],
        usage=row["usage"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
    )


def event_from_row(row: Mapping[Any, Any]) -> StoredEvent:
    return StoredEvent(
        run_id=row["run_id"],
        seq=row["seq"],
        kind=RunState(row["kind"]),
        tenant_id=row["tenant_id"],
        payload=row["payload"],
        created_at=row["created_at"],
        traceparent=row["traceparent"],
    )


class EventStore:
    """The append/read interface every service uses."""

    def __init__(self, db: Database) -> None:
        self.db = db

    async def append(
        self,
        run_id: str,
        expected_seq: int,
        events: Sequence[NewEvent],
        *,
        new_run: NewRun | None = None,
        lease_epoch: int | None = None,
        traceparent: str = "",
    ) -> list[StoredEvent]:
        append = Append(run_id, expected_seq, events, new_run, lease_epoch, traceparent)
        async with self.db.begin() as conn:
            return await append_in(conn, append)

    async def append_batch(self, appends: Sequence[Append]) -> list[StoredEvent]:
        """Appends to several runs in one transaction: all land or none does."""
        async with self.db.begin() as conn:
            return await append_all_in(conn, appends)

    async def read(
        self, run_id: str, after_seq: int = 0, limit: int | None = None
    ) -> list[StoredEvent]:
        query = (
            sa.select(run_events)
            .where(run_events.c.run_id == run_id, run_events.c.seq > after_seq)
            .order_by(run_events.c.seq)
            .limit(limit)
        )
        async with single_statement(self.db) as conn:
            return [event_from_row(row._mapping) for row in await conn.execute(query)]

    async def get_run(self, run_id: str) -> RunView | None:
        async with single_statement(self.db) as conn:
            row = (await conn.execute(sa.select(runs).where(runs.c.run_id == run_id))).first()
        return view_from_row(row._mapping) if row else None

    async def acquire_lease(self, run_id: str, owner: str) -> int:
        """Moves the run to a new lease epoch owned by `owner`; older epochs are fenced off."""
        async with self.db.begin() as conn:
            epoch = await conn.scalar(
                runs.update()
                .where(runs.c.run_id == run_id)
                .values(lease_epoch=runs.c.lease_epoch + 1, owner=owner)
                .returning(runs.c.lease_epoch)
            )
        if epoch is None:
            raise RunNotFound(run_id)
        return int(epoch)
