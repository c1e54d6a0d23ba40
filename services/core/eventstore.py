"""PostgreSQL event store: append with optimistic concurrency, read, leases.

An append runs in one transaction: it locks the run's projection row, checks
the expected seq and the lease epoch, folds the new events through the state
machine (services.core.runs), writes the events, the projection and the outbox
rows, and notifies the relay.  Any failure raises and writes nothing.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from services.core.db import EVENTS_CHANNEL
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


async def append_in(conn: AsyncConnection, append: Append) -> list[StoredEvent]:
    """Appends inside the caller's transaction, so other effects commit with it."""
    if not append.events:
        raise ValueError("an append needs at least one event")
    if append.expected_seq == 0:
        view = await _insert_run(conn, append)
    else:
        view = await _lock_run(conn, append)
        view = apply_events(view, append.events)
        await _update_run(conn, view)
    return await _insert_events(conn, view, append)


async def _insert_run(conn: AsyncConnection, append: Append) -> RunView:
    if append.new_run is None:
        raise ValueError("the first append of a run needs new_run")
    view = apply_events(RunView.new(append.run_id, append.new_run), append.events)
    values = _view_values(view)
    inserted = await conn.execute(
        pg_insert(runs).values(**values).on_conflict_do_nothing().returning(runs.c.run_id)
    )
    if inserted.first() is None:
        await _raise_insert_conflict(conn, append)
    return view


async def _raise_insert_conflict(conn: AsyncConnection, append: Append) -> None:
    existing = await conn.scalar(sa.select(runs.c.last_seq).where(runs.c.run_id == append.run_id))
    if existing is not None:
        raise ConcurrencyConflict(append.run_id, 0, existing)
    assert append.new_run is not None
    other = await conn.scalar(
        sa.select(runs.c.run_id).where(
            runs.c.tenant_id == append.new_run.tenant_id,
            runs.c.idempotency_key == append.new_run.idempotency_key,
        )
    )
    raise IdempotencyKeyTaken(append.run_id, str(other))


async def _lock_run(conn: AsyncConnection, append: Append) -> RunView:
    row = (
        await conn.execute(sa.select(runs).where(runs.c.run_id == append.run_id).with_for_update())
    ).first()
    if row is None:
        raise RunNotFound(append.run_id)
    view = view_from_row(row._mapping)
    if view.last_seq != append.expected_seq:
        raise ConcurrencyConflict(append.run_id, append.expected_seq, view.last_seq)
    if append.lease_epoch is not None and append.lease_epoch != view.lease_epoch:
        raise StaleLease(append.run_id, append.lease_epoch, view.lease_epoch)
    return view


async def _update_run(conn: AsyncConnection, view: RunView) -> None:
    await conn.execute(
        runs.update()
        .where(runs.c.run_id == view.run_id)
        .values(
            state=str(view.state),
            last_seq=view.last_seq,
            usage=dict(view.usage),
            finish_reason=view.finish_reason,
            updated_at=sa.func.clock_timestamp(),
        )
    )


# One round trip for any number of events: the events, their outbox rows and
# the relay's wake-up, all in the caller's transaction.
_INSERT_EVENTS = sa.text(
    """
    WITH ev AS (
        INSERT INTO run_events (run_id, seq, kind, tenant_id, payload, traceparent)
        SELECT :run_id, :first_seq + t.n - 1, t.kind, :tenant_id, t.payload::json, :traceparent
        FROM unnest(CAST(:kinds AS text[]), CAST(:payloads AS text[]))
            WITH ORDINALITY AS t(kind, payload, n)
        RETURNING run_id, seq, kind, tenant_id, payload, traceparent, created_at
    ), ob AS (
        INSERT INTO outbox (run_id, seq) SELECT run_id, seq FROM ev
    )
    SELECT ev.*, pg_notify(:channel, :run_id) AS notified FROM ev ORDER BY seq
    """
)


async def _insert_events(conn: AsyncConnection, view: RunView, append: Append) -> list[StoredEvent]:
    result = await conn.execute(
        _INSERT_EVENTS,
        {
            "run_id": view.run_id,
            "first_seq": append.expected_seq + 1,
            "tenant_id": view.tenant_id,
            "traceparent": append.traceparent,
            "kinds": [str(event.kind) for event in append.events],
            "payloads": [json.dumps(dict(event.payload)) for event in append.events],
            "channel": EVENTS_CHANNEL,
        },
    )
    return [event_from_row(row._mapping) for row in result]


def _view_values(view: RunView) -> dict[str, Any]:
    values = dataclasses.asdict(view)
    values.update(
        state=str(view.state),
        usage=dict(view.usage),
        created_at=sa.func.clock_timestamp(),
        updated_at=sa.func.clock_timestamp(),
    )
    return values


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

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

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
        async with self.engine.begin() as conn:
            return await append_in(conn, append)

    async def append_batch(self, appends: Sequence[Append]) -> list[StoredEvent]:
        """Appends to several runs in one transaction: all land or none does."""
        stored: list[StoredEvent] = []
        async with self.engine.begin() as conn:
            for append in appends:
                stored.extend(await append_in(conn, append))
        return stored

    async def read(
        self, run_id: str, after_seq: int = 0, limit: int | None = None
    ) -> list[StoredEvent]:
        query = (
            sa.select(run_events)
            .where(run_events.c.run_id == run_id, run_events.c.seq > after_seq)
            .order_by(run_events.c.seq)
            .limit(limit)
        )
        async with self.engine.connect() as conn:
            return [event_from_row(row._mapping) for row in await conn.execute(query)]

    async def get_run(self, run_id: str) -> RunView | None:
        async with self.engine.connect() as conn:
            row = (await conn.execute(sa.select(runs).where(runs.c.run_id == run_id))).first()
        return view_from_row(row._mapping) if row else None

    async def acquire_lease(self, run_id: str, owner: str) -> int:
        """Moves the run to a new lease epoch owned by `owner`; older epochs are fenced off."""
        async with self.engine.begin() as conn:
            epoch = await conn.scalar(
                runs.update()
                .where(runs.c.run_id == run_id)
                .values(lease_epoch=runs.c.lease_epoch + 1, owner=owner)
                .returning(runs.c.lease_epoch)
            )
        if epoch is None:
            raise RunNotFound(run_id)
        return int(epoch)
