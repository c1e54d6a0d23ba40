"""The limits of a tenant and its key, and what each holds now, read from PostgreSQL.

Admission reads them under the tenant's row lock (`lock=True`), which every admission of
the tenant takes, so the usage it reads is exact until it commits; GetUsage reads them
without the lock. SetQuota, under the same lock, starts a budget at what its period
already spent (`recount_budget`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from services.core.db import driver_cursor
from services.core.quotas import QuotaLimits, SubjectUsage, WindowEntry, period_end

RATE_FIELDS = (
    "requests_per_minute",
    "input_tokens_per_minute",
    "output_tokens_per_minute",
    "budget_micros",
    "budget_period",
)

_LIMITS = f"""
    SELECT t.weight, t.max_kv_blocks, t.max_concurrent_runs,
           {", ".join(f"t.{name}" for name in RATE_FIELDS)},
           k.key_id AS key_quota_id, k.max_kv_blocks AS key_max_kv_blocks,
           k.max_concurrent_runs AS key_max_concurrent_runs,
           {", ".join(f"k.{name} AS key_{name}" for name in RATE_FIELDS)}
    FROM tenants t LEFT JOIN key_quotas k ON k.key_id = %(key_id)s AND k.tenant_id = t.tenant_id
    WHERE t.tenant_id = %(tenant_id)s
"""


@dataclass(frozen=True, slots=True)
class TenantLimits:
    weight: int
    tenant: QuotaLimits
    key: QuotaLimits | None  # None: the key has no limits of its own


async def load_limits(
    conn: AsyncConnection, tenant_id: str, key_id: str, lock: bool = False
) -> TenantLimits | None:
    """The tenant's limits and its key's; None when the tenant does not exist. With
    `lock`, holds the tenant's row lock until the transaction ends."""
    async with driver_cursor(conn) as cursor:
        await cursor.execute(
            _LIMITS + (" FOR UPDATE OF t" if lock else ""),
            {"tenant_id": tenant_id, "key_id": key_id},
        )
        row = await cursor.fetchone()
    if row is None:
        return None
    key = _limits(row, "key_") if row["key_quota_id"] is not None else None
    return TenantLimits(int(row["weight"]), _limits(row, ""), key)


def _limits(row: Mapping[str, Any], prefix: str) -> QuotaLimits:
    return QuotaLimits(
        requests_per_minute=row[f"{prefix}requests_per_minute"],
        input_tokens_per_minute=row[f"{prefix}input_tokens_per_minute"],
        output_tokens_per_minute=row[f"{prefix}output_tokens_per_minute"],
        budget_micros=row[f"{prefix}budget_micros"],
        budget_period=row[f"{prefix}budget_period"],
        max_concurrent_runs=row[f"{prefix}max_concurrent_runs"] or 0,
        max_kv_blocks=row[f"{prefix}max_kv_blocks"] or 0,
    )


# What one subject holds: the `%(...)s` flags skip what its limits do not need (each a
# one-time filter, so a skipped part reads nothing). The window is exact: an admission
# counts while it is less than a minute old.
_SUBJECT = """
    SELECT {n} AS i, now.t AS now, held.runs AS open_runs, held.blocks AS open_blocks,
           win.requests, win.input_tokens, win.output_tokens, win.oldest,
           period.start AS period_start, coalesce(spent.spent_micros, 0) AS spent_micros
    FROM now
    CROSS JOIN LATERAL (
        SELECT count(*) AS runs, coalesce(sum(num_kv_blocks), 0) AS blocks
        FROM kv_reservations
        WHERE %(held{n})s AND {column} = %(id{n})s AND released_at IS NULL
    ) held
    CROSS JOIN LATERAL (
        SELECT count(*) AS requests, coalesce(sum(input_tokens), 0) AS input_tokens,
               coalesce(sum(output_tokens), 0) AS output_tokens, min(reserved_at) AS oldest
        FROM kv_reservations
        WHERE %(rates{n})s AND {column} = %(id{n})s AND reserved_at > now.t - interval '1 minute'
    ) win
    CROSS JOIN LATERAL (SELECT date_trunc(%(period{n})s, now.t, 'UTC') AS start) period
    LEFT JOIN budget_spend spent
        ON %(budget{n})s AND spent.subject = %(subject{n})s AND spent.period_start = period.start
"""

_NOW = "WITH now AS (SELECT clock_timestamp() AS t) "


@dataclass(frozen=True, slots=True)
class Subject:
    """A tenant (`column` tenant_id) or one of its keys (key_id) and its limits."""

    subject: str
    column: str
    id: str
    limits: QuotaLimits
    count_held: bool


def tenant_subject(tenant_id: str, limits: QuotaLimits) -> Subject:
    return Subject(f"tenant:{tenant_id}", "tenant_id", tenant_id, limits, True)


def key_subject(key_id: str, limits: QuotaLimits) -> Subject:
    held = bool(limits.max_concurrent_runs or limits.max_kv_blocks)
    return Subject(f"key:{key_id}", "key_id", key_id, limits, held)


def subjects(tenant_id: str, key_id: str, limits: TenantLimits) -> list[Subject]:
    found = [tenant_subject(tenant_id, limits.tenant)]
    if limits.key is not None and key_id:
        found.append(key_subject(key_id, limits.key))
    return found


@dataclass(frozen=True, slots=True)
class Snapshot:
    now: datetime  # the database's clock
    usages: list[SubjectUsage]
    period_starts: list[datetime]  # each subject's budget period


async def usage_now(conn: AsyncConnection, of: list[Subject]) -> Snapshot:
    """Each subject's usage at one instant, the database's clock's."""
    parts, params = [], {}
    for n, subject in enumerate(of):
        parts.append(_SUBJECT.format(n=n, column=subject.column))
        params.update(
            {
                f"held{n}": subject.count_held,
                f"id{n}": subject.id,
                f"rates{n}": subject.limits.has_rates,
                f"period{n}": subject.limits.budget_period,
                f"budget{n}": bool(subject.limits.budget_micros),
                f"subject{n}": subject.subject,
            }
        )
    async with driver_cursor(conn) as cursor:
        await cursor.execute(_NOW + " UNION ALL ".join(parts) + " ORDER BY i", params)
        rows = await cursor.fetchall()
    return Snapshot(
        now=rows[0]["now"],
        usages=[_usage(subject, row) for subject, row in zip(of, rows, strict=True)],
        period_starts=[row["period_start"] for row in rows],
    )


def _usage(subject: Subject, row: Mapping[str, Any]) -> SubjectUsage:
    now: datetime = row["now"]
    start: datetime = row["period_start"]
    oldest: datetime | None = row["oldest"]
    return SubjectUsage(
        subject=subject.subject,
        limits=subject.limits,
        now=now.timestamp(),
        open_runs=int(row["open_runs"]),
        open_blocks=int(row["open_blocks"]),
        requests=int(row["requests"]),
        input_tokens=int(row["input_tokens"]),
        output_tokens=int(row["output_tokens"]),
        oldest_at=oldest.timestamp() if oldest else None,
        spent_micros=int(row["spent_micros"]),
        period_end=period_end(start, subject.limits.budget_period).timestamp(),
    )


_WINDOW = """
    SELECT reserved_at, input_tokens, output_tokens FROM kv_reservations
    WHERE {column} = %(id)s AND reserved_at > to_timestamp(%(now)s) - interval '1 minute'
"""


async def window_entries(conn: AsyncConnection, subject: Subject, now: float) -> list[WindowEntry]:
    """The subject's admissions of the minute before `now`: to tell when one fits."""
    async with driver_cursor(conn) as cursor:
        await cursor.execute(_WINDOW.format(column=subject.column), {"id": subject.id, "now": now})
        rows = await cursor.fetchall()
    return [
        WindowEntry(row["reserved_at"].timestamp(), row["input_tokens"], row["output_tokens"])
        for row in rows
    ]


# The rows of the subject's runs in flight admitted in the period. Billing locks a run's
# row before it settles the run's reservation, so holding them keeps every bill of these
# runs wholly before the recount (which then reads it) or wholly after (which then reads
# the stamp and the row the recount wrote).
_LOCK_IN_FLIGHT = """
    SELECT runs.run_id FROM kv_reservations r JOIN runs ON runs.run_id = r.run_id
    WHERE r.{column} = %(id)s AND r.reserved_at >= %(start)s AND r.released_at IS NULL
    ORDER BY runs.run_id
    FOR UPDATE OF runs
"""

# The period's spend as admission and billing keep it: each run admitted in the period
# at its billed amount (the ledger's entries) once billed, at its worst case while in
# flight. The runs in flight are stamped with the period, so billing settles this row.
_RECOUNT = """
    WITH in_flight AS (
        UPDATE kv_reservations SET {column_start} = %(start)s
        WHERE {column} = %(id)s AND reserved_at >= %(start)s AND released_at IS NULL
        RETURNING spend_micros
    ), billed AS (
        SELECT e.amount_micros
        FROM kv_reservations r JOIN ledger_entries e ON e.run_id = r.run_id
        WHERE r.{column} = %(id)s AND r.reserved_at >= %(start)s AND r.released_at IS NOT NULL
    )
    INSERT INTO budget_spend (subject, period_start, spent_micros)
    VALUES (%(subject)s, %(start)s,
            (SELECT coalesce(sum(spend_micros), 0) FROM in_flight)
            + (SELECT coalesce(sum(amount_micros), 0) FROM billed))
    ON CONFLICT (subject, period_start) DO UPDATE SET spent_micros = excluded.spent_micros
    RETURNING spent_micros
"""


async def recount_budget(conn: AsyncConnection, subject: Subject) -> int:
    """Sets the subject's spend in its current budget period to what its runs admitted
    in the period cost so far, and charges its runs in flight to that period; returns
    the spend. For SetQuota, in its transaction and under the tenant's row lock, so that
    a budget set (or moved to another period) partway through counts what came before.

    A run admitted before the period stays charged to the period it was admitted in.
    """
    params: dict[str, Any] = {
        "id": subject.id,
        "subject": subject.subject,
        "period": subject.limits.budget_period,
    }
    column = subject.column
    column_start = column.removesuffix("_id") + "_budget_start"
    async with driver_cursor(conn) as cursor:
        await cursor.execute(
            "SELECT date_trunc(%(period)s, clock_timestamp(), 'UTC') AS start", params
        )
        row = await cursor.fetchone()
        assert row is not None
        params["start"] = row["start"]
        await cursor.execute(_LOCK_IN_FLIGHT.format(column=column), params)
        await cursor.execute(_RECOUNT.format(column=column, column_start=column_start), params)
        spent = await cursor.fetchone()
    assert spent is not None
    return int(spent["spent_micros"])
