"""Admitting a run: quotas, KV reservation and the `queued` event, in one transaction."""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from services.admission.attachments import attach_in
from services.admission.requests import GenerateParams
from services.core.db import Database, driver_cursor, single_statement
from services.core.errors import NotFound, QuotaExceeded
from services.core.eventstore import Append, append_in, view_from_row
from services.core.runs import NewEvent, NewRun, RunState, RunView, StoredEvent
from services.core.schema import runs

QUOTA_RETRY_SECONDS = 2.0


@dataclass(frozen=True, slots=True)
class Admission:
    run_id: str
    tenant_id: str
    params: GenerateParams
    prompt_token_ids: list[int]
    num_kv_blocks: int
    traceparent: str = ""
    # The admission replica that streams the run first: it holds the run's first lease.
    replica_id: str = ""

    @property
    def idempotency_key(self) -> str:
        return self.params.idempotency_key or f"run:{self.run_id}"

    def queued_payload(self) -> dict[str, object]:
        return {
            "model": self.params.model,
            "priority": f"PRIORITY_{self.params.priority.upper()}",
            "sampling": self.params.sampling.payload(),
            "prompt_token_ids": self.prompt_token_ids,
            "idempotency_key": self.idempotency_key,
            "num_kv_blocks": self.num_kv_blocks,
        }


@dataclass(frozen=True, slots=True)
class Admitted:
    """What admitting stored: enough for the scheduler to queue the run as it is."""

    admission: Admission
    queued: StoredEvent
    tenant_weight: int


async def admit(db: Database, admission: Admission) -> Admitted:
    """Appends `queued`, then checks the tenant's quotas and reserves KV blocks.

    Raises QuotaExceeded, or IdempotencyKeyTaken when another run holds the key. The
    tenant row lock serializes this tenant's admissions, so it is taken last: held for
    one statement and the commit, not for the whole transaction.
    """
    async with db.begin() as conn:
        new_run = NewRun(
            tenant_id=admission.tenant_id,
            model=admission.params.model,
            priority=admission.params.priority,
            idempotency_key=admission.idempotency_key,
            request_hash=admission.params.request_hash(),
        )
        event = NewEvent(RunState.QUEUED, admission.queued_payload())
        [queued] = await append_in(
            conn, Append(admission.run_id, 0, [event], new_run, None, admission.traceparent)
        )
        weight = await _reserve(conn, admission)
        if admission.replica_id:
            await attach_in(
                conn, admission.run_id, admission.replica_id, admission.params.disconnect_grace
            )
    return Admitted(admission, queued, weight)


# Counts the tenant's open reservations and inserts this run's when both quotas allow it.
# A statement of its own after the lock: its snapshot sees every reservation committed
# by the admissions that held the lock before.
_RESERVE = """
    WITH open AS (
        SELECT coalesce(sum(num_kv_blocks), 0) AS blocks, count(*) AS runs
        FROM kv_reservations WHERE tenant_id = %(tenant_id)s AND released_at IS NULL
    ), reserved AS (
        INSERT INTO kv_reservations (run_id, tenant_id, num_kv_blocks, reserved_at)
        SELECT %(run_id)s, %(tenant_id)s, %(num_kv_blocks)s, clock_timestamp() FROM open
        WHERE (%(max_blocks)s = 0 OR open.blocks + %(num_kv_blocks)s <= %(max_blocks)s)
          AND (%(max_runs)s = 0 OR open.runs < %(max_runs)s)
        RETURNING 1
    )
    SELECT open.blocks, open.runs, EXISTS (SELECT FROM reserved) AS reserved FROM open
"""

_LOCK_TENANT = """
    SELECT max_kv_blocks, max_concurrent_runs, weight FROM tenants
    WHERE tenant_id = %s FOR UPDATE
"""


async def _reserve(conn: AsyncConnection, admission: Admission) -> int:
    """Reserves the run's KV blocks within the tenant's quotas; returns the tenant's weight."""
    async with driver_cursor(conn) as cursor:
        await cursor.execute(_LOCK_TENANT, (admission.tenant_id,))
        tenant = await cursor.fetchone()
        if tenant is None:
            raise NotFound(f"tenant {admission.tenant_id} does not exist")
        max_blocks = tenant["max_kv_blocks"] or 0
        max_runs = tenant["max_concurrent_runs"] or 0
        await cursor.execute(
            _RESERVE,
            {
                "tenant_id": admission.tenant_id,
                "run_id": admission.run_id,
                "num_kv_blocks": admission.num_kv_blocks,
                "max_blocks": max_blocks,
                "max_runs": max_runs,
            },
        )
        reserved = await cursor.fetchone()
    assert reserved is not None
    open_blocks, open_runs = reserved["blocks"], reserved["runs"]
    if reserved["reserved"]:
        return int(tenant["weight"])
    if max_blocks and open_blocks + admission.num_kv_blocks > max_blocks:
        raise QuotaExceeded(
            f"KV quota: {open_blocks} of {max_blocks} blocks reserved, this run needs {admission.num_kv_blocks}",
            subject=f"tenant:{admission.tenant_id}:kv_blocks",
            retry_after=QUOTA_RETRY_SECONDS,
            reason="KV_LIMITED",
        )
    raise QuotaExceeded(
        f"concurrency quota: {open_runs} of {max_runs} runs in flight",
        subject=f"tenant:{admission.tenant_id}:concurrent_runs",
        retry_after=QUOTA_RETRY_SECONDS,
        reason="CONCURRENCY_LIMITED",
    )


async def find_by_idempotency_key(db: Database, tenant_id: str, key: str) -> RunView | None:
    async with single_statement(db) as conn:
        row = (
            await conn.execute(
                sa.select(runs).where(runs.c.tenant_id == tenant_id, runs.c.idempotency_key == key)
            )
        ).first()
    return view_from_row(row._mapping) if row else None
