"""The operator console's figures that PostgreSQL holds: latency and throughput from the
run events, top tenants from the ledger, and the relay's lag from the outbox.

Latency comes from the events rather than a metrics registry because admission's own
registry never sees a token: the events are the one record every replica shares. A
`streaming` event is one engine step, so its inter-token latency is the gap since the
previous step divided by the tokens it carries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.core.db import Database, driver_cursor, single_statement
from services.core.runs import RunState
from services.ledger.pricing import BILLING_TYPES

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


# The first `streaming` event of a run follows its `queued` one (its TTFT); each later
# one follows a `streaming` one (an ITL sample). Prefill and requeue events are skipped
# by the filter on kinds, so the gaps are between the kinds named.
_LATENCY = """
    WITH recent AS (
        SELECT run_id FROM runs WHERE created_at >= now() - make_interval(secs => %(window)s)
    ), steps AS (
        SELECT e.kind, e.created_at,
               CASE WHEN e.kind = %(streaming)s
                    THEN json_array_length(e.payload -> 'token_ids') ELSE 0 END AS num_tokens,
               lag(e.kind) OVER w AS previous_kind,
               extract(epoch FROM e.created_at - lag(e.created_at) OVER w) AS gap
        FROM run_events e JOIN recent ON recent.run_id = e.run_id
        WHERE e.kind IN (%(queued)s, %(streaming)s)
        WINDOW w AS (PARTITION BY e.run_id ORDER BY e.seq)
    ), samples AS (
        SELECT CASE WHEN previous_kind = %(queued)s THEN gap END AS ttft,
               CASE WHEN previous_kind = %(streaming)s
                    THEN gap / greatest(num_tokens, 1) END AS itl,
               num_tokens
        FROM steps WHERE kind = %(streaming)s
    )
    SELECT (SELECT count(*) FROM recent) AS num_runs,
           percentile_cont(0.5) WITHIN GROUP (ORDER BY ttft) AS ttft_p50,
           percentile_cont(0.99) WITHIN GROUP (ORDER BY ttft) AS ttft_p99,
           percentile_cont(0.5) WITHIN GROUP (ORDER BY itl) AS itl_p50,
           percentile_cont(0.99) WITHIN GROUP (ORDER BY itl) AS itl_p99,
           coalesce(sum(num_tokens), 0) AS num_output_tokens
    FROM samples
"""

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
    params = {
        "window": window_seconds,
        "queued": _QUEUED,
        "streaming": _STREAMING,
    }
    row = await _one(db, _LATENCY, params)
    return Latency(
        window_seconds=window_seconds,
        num_runs=int(row["num_runs"]),
        ttft_p50=_seconds(row["ttft_p50"]),
        ttft_p99=_seconds(row["ttft_p99"]),
        itl_p50=_seconds(row["itl_p50"]),
        itl_p99=_seconds(row["itl_p99"]),
        num_output_tokens=int(row["num_output_tokens"]),
    )


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
