"""The ledger's SQL: billing writes, the sweep's scan and the read side."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from services.core.eventstore import view_from_row
from services.core.runs import TERMINAL_STATES, RunState, RunView
from services.core.schema import kv_reservations, ledger_entries, run_events, runs
from services.ledger.pricing import BILLING_TYPES, LedgerEntry

_TERMINAL = sorted(str(state) for state in TERMINAL_STATES)
# Far more than a healthy system ever reports; keeps one reply bounded.
MAX_REPORTED_RUNS = 1000


async def lock_run(conn: AsyncConnection, run_id: str) -> RunView | None:
    """The run's projection row, locked until the transaction ends."""
    row = (
        await conn.execute(sa.select(runs).where(runs.c.run_id == run_id).with_for_update())
    ).first()
    return view_from_row(cast(Mapping[str, Any], row._mapping)) if row else None


async def traceparent_of(conn: AsyncConnection, run_id: str, seq: int) -> str:
    """The trace context the event at `seq` was appended under ("" if none)."""
    value = await conn.scalar(
        sa.select(run_events.c.traceparent).where(
            run_events.c.run_id == run_id, run_events.c.seq == seq
        )
    )
    return str(value or "")


async def insert_entries(conn: AsyncConnection, entries: Sequence[LedgerEntry]) -> None:
    rows = [
        {
            "entry_id": e.entry_id,
            "tenant_id": e.tenant_id,
            "run_id": e.run_id,
            "idempotency_key": e.idempotency_key,
            "billing_type": e.billing_type,
            "model": e.model,
            "quantity": e.quantity,
            "unit_price_micros": e.unit_price_micros,
            "amount_micros": e.amount_micros,
            "currency": e.currency,
        }
        for e in entries
    ]
    # One statement whatever the number of entries (compiled once), `created_at` from
    # the column's default.
    await conn.execute(pg_insert(ledger_entries).on_conflict_do_nothing(), rows)


async def entries_for_key(
    conn: AsyncConnection, tenant_id: str, idempotency_key: str
) -> list[LedgerEntry]:
    query = (
        sa.select(ledger_entries)
        .where(
            ledger_entries.c.tenant_id == tenant_id,
            ledger_entries.c.idempotency_key == idempotency_key,
        )
        .order_by(ledger_entries.c.created_at, ledger_entries.c.entry_id)
    )
    return [entry_from_row(row._mapping) for row in await conn.execute(query)]


async def release_reservation(conn: AsyncConnection, run_id: str) -> int:
    """Releases the run's KV reservation if still held; returns how many rows changed."""
    result = await conn.execute(
        kv_reservations.update()
        .where(kv_reservations.c.run_id == run_id, kv_reservations.c.released_at.is_(None))
        .values(released_at=sa.func.now())
    )
    return int(result.rowcount or 0)


def _overdue(grace_seconds: float) -> sa.ColumnElement[bool]:
    cutoff = sa.func.now() - sa.literal_column("interval '1 second'") * float(grace_seconds)
    return sa.and_(runs.c.state.in_(_TERMINAL), runs.c.updated_at < cutoff)


async def overdue_run_ids(
    conn: AsyncConnection,
    grace_seconds: float,
    tenant_id: str | None = None,
    limit: int = MAX_REPORTED_RUNS,
) -> list[str]:
    """Terminal runs left unbilled for longer than the grace period, oldest first."""
    query = sa.select(runs.c.run_id).where(_overdue(grace_seconds))
    if tenant_id is not None:
        query = query.where(runs.c.tenant_id == tenant_id)
    query = query.order_by(runs.c.updated_at, runs.c.run_id).limit(limit)
    return list((await conn.scalars(query)).all())


async def unreleased_run_ids(conn: AsyncConnection, tenant_id: str | None) -> list[str]:
    query = (
        sa.select(runs.c.run_id)
        .join(kv_reservations, kv_reservations.c.run_id == runs.c.run_id)
        .where(runs.c.state == str(RunState.BILLED), kv_reservations.c.released_at.is_(None))
    )
    if tenant_id is not None:
        query = query.where(runs.c.tenant_id == tenant_id)
    query = query.order_by(runs.c.run_id).limit(MAX_REPORTED_RUNS)
    return list((await conn.scalars(query)).all())


async def mismatched_run_ids(conn: AsyncConnection, tenant_id: str | None) -> list[str]:
    """Billed runs whose entries do not add up to their `billed` event."""
    totals = (
        sa.select(
            ledger_entries.c.run_id,
            sa.func.count().label("num_entries"),
            sa.func.sum(ledger_entries.c.amount_micros).label("amount_micros"),
        )
        .group_by(ledger_entries.c.run_id)
        .subquery()
    )
    billed_amount = sa.cast(run_events.c.payload["amount_micros"].astext, sa.BigInteger)
    query = (
        sa.select(runs.c.run_id)
        .join(
            run_events,
            sa.and_(
                run_events.c.run_id == runs.c.run_id,
                run_events.c.kind == str(RunState.BILLED),
            ),
        )
        .outerjoin(totals, totals.c.run_id == runs.c.run_id)
        .where(
            runs.c.state == str(RunState.BILLED),
            sa.or_(
                sa.func.coalesce(totals.c.num_entries, 0) != len(BILLING_TYPES),
                sa.func.coalesce(totals.c.amount_micros, 0) != sa.func.coalesce(billed_amount, 0),
            ),
        )
    )
    if tenant_id is not None:
        query = query.where(runs.c.tenant_id == tenant_id)
    query = query.order_by(runs.c.run_id).limit(MAX_REPORTED_RUNS)
    return list((await conn.scalars(query)).all())


async def run_tenant(conn: AsyncConnection, run_id: str) -> str | None:
    return await conn.scalar(sa.select(runs.c.tenant_id).where(runs.c.run_id == run_id))


@dataclass(frozen=True, slots=True)
class EntryFilter:
    tenant_id: str | None = None
    run_id: str | None = None


async def list_entries(
    conn: AsyncConnection,
    where: EntryFilter,
    after: tuple[datetime, str] | None,
    limit: int,
) -> list[LedgerEntry]:
    """Entries in (created_at, entry_id) order, strictly after the `after` key."""
    query = sa.select(ledger_entries)
    if where.tenant_id is not None:
        query = query.where(ledger_entries.c.tenant_id == where.tenant_id)
    if where.run_id is not None:
        query = query.where(ledger_entries.c.run_id == where.run_id)
    if after is not None:
        query = query.where(
            sa.tuple_(ledger_entries.c.created_at, ledger_entries.c.entry_id) > sa.tuple_(*after)
        )
    query = query.order_by(ledger_entries.c.created_at, ledger_entries.c.entry_id).limit(limit)
    return [entry_from_row(row._mapping) for row in await conn.execute(query)]


@dataclass(frozen=True, slots=True)
class UsageTotals:
    num_runs: int
    quantities: Mapping[str, int]
    amounts: Mapping[str, int]


async def usage_totals(
    conn: AsyncConnection,
    tenant_id: str | None,
    start: datetime | None,
    end: datetime | None,
) -> UsageTotals:
    """Sums over entries created in [start, end); None leaves that side open."""
    conditions = []
    if tenant_id is not None:
        conditions.append(ledger_entries.c.tenant_id == tenant_id)
    if start is not None:
        conditions.append(ledger_entries.c.created_at >= start)
    if end is not None:
        conditions.append(ledger_entries.c.created_at < end)
    lines = await conn.execute(
        sa.select(
            ledger_entries.c.billing_type,
            sa.func.sum(ledger_entries.c.quantity),
            sa.func.sum(ledger_entries.c.amount_micros),
        )
        .where(*conditions)
        .group_by(ledger_entries.c.billing_type)
    )
    quantities: dict[str, int] = {}
    amounts: dict[str, int] = {}
    for billing_type, quantity, amount in lines:
        quantities[billing_type] = int(quantity)
        amounts[billing_type] = int(amount)
    num_runs = await conn.scalar(
        sa.select(sa.func.count(sa.distinct(ledger_entries.c.run_id))).where(*conditions)
    )
    return UsageTotals(int(num_runs or 0), quantities, amounts)


def entry_from_row(row: Mapping[Any, Any]) -> LedgerEntry:
    return LedgerEntry(
        entry_id=row["entry_id"],
        tenant_id=row["tenant_id"],
        run_id=row["run_id"],
        idempotency_key=row["idempotency_key"],
        billing_type=row["billing_type"],
        model=row["model"],
        quantity=row["quantity"],
        unit_price_micros=row["unit_price_micros"],
        amount_micros=row["amount_micros"],
        currency=row["currency"],
        created_at=row["created_at"],
    )
