"""The ledger's SQL: billing writes, the sweep's scan and the read side."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from services.core.db import driver_cursor
from services.core.event_store import view_from_row
from services.core.pricing import BillableRun, LedgerEntry
from services.core.runs import TERMINAL_STATES, RunView
from services.core.schema import ledger_entries, runs

_TERMINAL = sorted(str(state) for state in TERMINAL_STATES)
# Far more than a healthy system ever reports; keeps one reply bounded.
MAX_REPORTED_RUNS = 1000


_LOCK_RUN = """
    SELECT runs.*, (
        SELECT traceparent FROM run_events
        WHERE run_events.run_id = runs.run_id AND run_events.seq = runs.last_seq
    ) AS last_traceparent
    FROM runs WHERE run_id = %s
    FOR UPDATE OF runs
"""


async def lock_run(conn: AsyncConnection, run_id: str) -> tuple[RunView, str] | None:
    """The run's projection row, locked until the transaction ends, and the trace
    context its last event was appended under ("" if none)."""
    async with driver_cursor(conn) as cursor:
        await cursor.execute(_LOCK_RUN, (run_id,))
        row = await cursor.fetchone()
    return (view_from_row(row), row["last_traceparent"] or "") if row else None


# One statement: the run's entries (a repeat of a key already there is left alone), the
# release of its reservation if still held, settled to the run's actual tokens and cost
# (the rate windows and the budgets it was charged to then count those, not the worst
# case reserved), and every entry the ledger then holds for the key (the inserted rows
# and any there before: one snapshot sees only the latter). Budget rows are taken in
# subject order, as admission takes them.
_WRITE_BILL = """
    WITH inserted AS (
        INSERT INTO ledger_entries (entry_id, tenant_id, run_id, idempotency_key, billing_type,
                                    model, quantity, unit_price_micros, amount_micros, currency,
                                    discount_micros)
        SELECT * FROM unnest(%(entry_ids)s::text[], %(tenant_ids)s::text[], %(run_ids)s::text[],
                             %(keys)s::text[], %(billing_types)s::text[], %(models)s::text[],
                             %(quantities)s::bigint[], %(unit_prices)s::bigint[],
                             %(amounts)s::bigint[], %(currencies)s::text[],
                             %(discounts)s::bigint[])
        ON CONFLICT DO NOTHING
        RETURNING *
    ), released AS (
        UPDATE kv_reservations r
        SET released_at = now(), input_tokens = %(input_tokens)s,
            output_tokens = %(output_tokens)s, spend_micros = %(spend_micros)s
        FROM kv_reservations before
        WHERE r.run_id = %(run_id)s AND r.released_at IS NULL AND before.run_id = r.run_id
        RETURNING r.tenant_id, r.key_id, r.tenant_budget_start, r.key_budget_start,
                  %(spend_micros)s - before.spend_micros AS settled_micros
    ), charged AS (
        SELECT b.subject, b.period_start, released.settled_micros
        FROM budget_spend b JOIN released
          ON (b.subject = 'tenant:' || released.tenant_id
              AND b.period_start = released.tenant_budget_start)
          OR (b.subject = 'key:' || released.key_id
              AND b.period_start = released.key_budget_start)
        ORDER BY b.subject
        FOR UPDATE OF b
    ), settled AS (
        UPDATE budget_spend b SET spent_micros = b.spent_micros + charged.settled_micros
        FROM charged
        WHERE b.subject = charged.subject AND b.period_start = charged.period_start
    ), held AS (
        SELECT * FROM inserted
        UNION ALL
        SELECT * FROM ledger_entries WHERE tenant_id = %(tenant_id)s AND idempotency_key = %(key)s
    )
    SELECT (SELECT count(*) FROM released) AS num_released, held.*
    FROM (SELECT) AS one LEFT JOIN held ON true
    ORDER BY held.created_at, held.entry_id
"""


async def write_bill(
    conn: AsyncConnection, run: BillableRun, entries: Sequence[LedgerEntry]
) -> tuple[list[LedgerEntry], int]:
    """Inserts `entries` and releases the run's KV reservation if still held; returns the
    entries the ledger holds for the run's key, as stored, and how many reservations
    were released (0 or 1)."""
    params = {
        "entry_ids": [e.entry_id for e in entries],
        "tenant_ids": [e.tenant_id for e in entries],
        "run_ids": [e.run_id for e in entries],
        "keys": [e.idempotency_key for e in entries],
        "billing_types": [e.billing_type for e in entries],
        "models": [e.model for e in entries],
        "quantities": [e.quantity for e in entries],
        "unit_prices": [e.unit_price_micros for e in entries],
        "amounts": [e.amount_micros for e in entries],
        "currencies": [e.currency for e in entries],
        "discounts": [e.discount_micros for e in entries],
        "run_id": run.run_id,
        "tenant_id": run.tenant_id,
        "key": run.idempotency_key,
        "input_tokens": run.usage.prompt_tokens,
        "output_tokens": run.usage.output_tokens,
        "spend_micros": sum(e.amount_micros for e in entries),
    }
    async with driver_cursor(conn) as cursor:
        await cursor.execute(_WRITE_BILL, params)
        rows = await cursor.fetchall()
    held = [entry_from_row(row) for row in rows if row["entry_id"] is not None]
    return held, int(rows[0]["num_released"])


def _ago(seconds: float) -> sa.ColumnElement[datetime]:
    return sa.func.now() - sa.literal_column("interval '1 second'") * float(seconds)


def _overdue(grace_seconds: float) -> sa.ColumnElement[bool]:
    return sa.and_(runs.c.state.in_(_TERMINAL), runs.c.updated_at < _ago(grace_seconds))


async def overdue_run_ids(
    conn: AsyncConnection,
    grace_seconds: float,
    tenant_id: str | None = None,
    limit: int = MAX_REPORTED_RUNS,
    created_since_seconds: float | None = None,
) -> list[str]:
    """Terminal runs left unbilled for longer than the grace period, oldest first; of
    one tenant, and created in the last `created_since_seconds`, when given."""
    query = sa.select(runs.c.run_id).where(_overdue(grace_seconds))
    if tenant_id is not None:
        query = query.where(runs.c.tenant_id == tenant_id)
    if created_since_seconds is not None:
        query = query.where(runs.c.created_at >= _ago(created_since_seconds))
    query = query.order_by(runs.c.updated_at, runs.c.run_id).limit(limit)
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
        discount_micros=row["discount_micros"],
    )
