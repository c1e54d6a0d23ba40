"""The operator console's figures that PostgreSQL holds: latency and throughput from the
run events, top tenants from the ledger, and the relay's lag from the outbox.

Latency comes from the events rather than a metrics registry because admission's own
registry never sees a token: the events are the one record every replica shares. A
`streaming` event is one engine step, so its inter-token latency is the gap since the
previous step divided by the tokens it carries. Its tokens are counted as the ledger's
reconciliation counts them: PostgreSQL's JSON operators refuse a payload holding an
escaped NUL, which a model may emit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from services.core.db import Database, driver_cursor, single_statement
from services.core.pricing import BILLING_TYPES
from services.core.runs import RunState
from services.core.schema import run_events, runs
from services.ledger.reconcile import streamed_tokens

_QUEUED, _STREAMING = str(RunState.QUEUED), str(RunState.STREAMING)
# Every token billed: input (uncached), cached input and output.
_TOKEN_TYPES = list(BILLING_TYPES)


@dataclass(frozen=True, slots=True)
class Latency:
    """Over the runs created in the last `window_seconds`; None where no run gives one."""

    window_seconds: float
    num_runs: int
    ttft_p50: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    num_output_tokens: int

    @property
    def tokens_per_second(self) -> float:
        return self.num_output_tokens / self.window_seconds


@dataclass(frozen=True, slots=True)
class TenantTotal:
    tenant_id: str
    name: str
    num_tokens: int
    amount_micros: int


@dataclass(frozen=True, slots=True)
class RelayLag:
    num_unpublished: int
    # How long the oldest unpublished event has waited; 0 when none waits.
    oldest_age_seconds: float


_TOP_TENANTS = """
    SELECT e.tenant_id, coalesce(t.name, '') AS name,
           sum(e.quantity) FILTER (WHERE e.billing_type = ANY(%(token_types)s)) AS num_tokens,
           sum(e.amount_micros) AS amount_micros
    FROM ledger_entries e LEFT JOIN tenants t ON t.tenant_id = e.tenant_id
    WHERE e.created_at >= now() - make_interval(secs => %(window)s)
    GROUP BY e.tenant_id, t.name
    ORDER BY amount_micros DESC, num_tokens DESC, e.tenant_id
    LIMIT %(limit)s
"""

# The relay publishes in id order, so the lowest unpublished id is the oldest waiting.
_RELAY_LAG = """
    SELECT (SELECT count(*) FROM outbox WHERE published_at IS NULL) AS num_unpublished,
           coalesce(extract(epoch FROM now() - (
               SELECT e.created_at FROM outbox o
               JOIN run_events e ON e.run_id = o.run_id AND e.seq = o.seq
               WHERE o.published_at IS NULL ORDER BY o.id LIMIT 1)), 0) AS oldest_age_seconds
"""


async def latency(db: Database, window_seconds: float) -> Latency:
    async with single_statement(db) as conn:
        row = (await conn.execute(_latency_query(window_seconds))).one()._mapping
    return Latency(
        window_seconds=window_seconds,
        num_runs=int(row["num_runs"]),
        ttft_p50=_seconds(row["ttft_p50"]),
        ttft_p99=_seconds(row["ttft_p99"]),
        itl_p50=_seconds(row["itl_p50"]),
        itl_p99=_seconds(row["itl_p99"]),
        num_output_tokens=int(row["num_output_tokens"]),
    )


def _latency_query(window_seconds: float) -> sa.Select[Any]:
    """One statement. Of a run's `queued` and `streaming` events in seq order, the first
    `streaming` one follows `queued` (its gap is the TTFT) and each later one follows a
    `streaming` one (an ITL sample); prefill and the rest are filtered out first."""
    since = sa.func.now() - sa.literal_column("interval '1 second'") * float(window_seconds)
    recent = sa.select(runs.c.run_id).where(runs.c.created_at >= since).cte("recent")
    e = run_events.c
    steps = (
        sa.select(
            e.kind,
            sa.case((e.kind == _STREAMING, streamed_tokens(e.payload)), else_=0).label(
                "num_tokens"
            ),
            _previous(e.kind).label("previous_kind"),
            sa.extract("epoch", e.created_at - _previous(e.created_at)).label("gap"),
        )
        .select_from(run_events.join(recent, recent.c.run_id == e.run_id))
        .where(e.kind.in_([_QUEUED, _STREAMING]))
        .cte("steps")
    )
    per_token = steps.c.gap / sa.func.greatest(steps.c.num_tokens, 1)
    samples = (
        sa.select(
            sa.case((steps.c.previous_kind == _QUEUED, steps.c.gap)).label("ttft"),
            sa.case((steps.c.previous_kind == _STREAMING, per_token)).label("itl"),
            steps.c.num_tokens,
        )
        .where(steps.c.kind == _STREAMING)
        .cte("samples")
    )
    num_runs = sa.select(sa.func.count()).select_from(recent).scalar_subquery()
    return sa.select(
        num_runs.label("num_runs"),
        *(
            sa.func.percentile_cont(q).within_group(column).label(f"{column.name}_p{name}")
            for column in (samples.c.ttft, samples.c.itl)
            for q, name in ((0.5, "50"), (0.99, "99"))
        ),
        sa.func.coalesce(sa.func.sum(samples.c.num_tokens), 0).label("num_output_tokens"),
    )


def _previous(column: sa.ColumnElement[Any]) -> sa.ColumnElement[Any]:
    """`column` of the run's event before this one (among those selected)."""
    return sa.func.lag(column).over(partition_by=run_events.c.run_id, order_by=run_events.c.seq)


async def top_tenants(db: Database, window_seconds: float, limit: int) -> list[TenantTotal]:
    """The tenants that spent most in the window (then by tokens), biggest first."""
    params = {"window": window_seconds, "token_types": _TOKEN_TYPES, "limit": limit}
    async with single_statement(db) as conn, driver_cursor(conn) as cursor:
        await cursor.execute(_TOP_TENANTS, params)
        rows = await cursor.fetchall()
    return [
        TenantTotal(
            tenant_id=row["tenant_id"],
            name=row["name"],
            num_tokens=int(row["num_tokens"] or 0),
            amount_micros=int(row["amount_micros"] or 0),
        )
        for row in rows
    ]


async def relay_lag(db: Database) -> RelayLag:
    row = await _one(db, _RELAY_LAG, {})
    return RelayLag(
        num_unpublished=int(row["num_unpublished"]),
        oldest_age_seconds=max(0.0, float(row["oldest_age_seconds"])),
    )


async def _one(db: Database, query: str, params: dict[str, Any]) -> dict[str, Any]:
    async with single_statement(db) as conn, driver_cursor(conn) as cursor:
        await cursor.execute(query, params)
        row = await cursor.fetchone()
    assert row is not None
    return row


def _seconds(value: Any) -> float | None:
    return None if value is None else float(value)
