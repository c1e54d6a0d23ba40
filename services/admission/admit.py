"""Admitting a run: quotas, KV reservation and the `queued` event, in one transaction."""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from services.admission.requests import GenerateParams
from services.core.errors import NotFound, QuotaExceeded
from services.core.eventstore import Append, append_in, view_from_row
from services.core.runs import NewEvent, NewRun, RunState, RunView
from services.core.schema import kv_reservations, runs, tenants

QUOTA_RETRY_SECONDS = 2.0


@dataclass(frozen=True, slots=True)
class Admission:
    run_id: str
    tenant_id: str
    params: GenerateParams
    prompt_token_ids: list[int]
    num_blocks: int
    traceparent: str = ""

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
            "kv_blocks_reserved": self.num_blocks,
        }


async def admit(engine: AsyncEngine, admission: Admission) -> None:
    """Checks the tenant's quotas, reserves KV blocks and appends `queued`.

    Raises QuotaExceeded, or IdempotencyKeyTaken when another run holds the key.
    """
    async with engine.begin() as conn:
        await _check_quotas(conn, admission)
        new_run = NewRun(
            tenant_id=admission.tenant_id,
            model=admission.params.model,
            priority=admission.params.priority,
            idempotency_key=admission.idempotency_key,
            request_hash=admission.params.request_hash(),
        )
        event = NewEvent(RunState.QUEUED, admission.queued_payload())
        await append_in(
            conn, Append(admission.run_id, 0, [event], new_run, None, admission.traceparent)
        )
        await conn.execute(
            kv_reservations.insert().values(
                run_id=admission.run_id,
                tenant_id=admission.tenant_id,
                num_blocks=admission.num_blocks,
                reserved_at=sa.func.clock_timestamp(),
            )
        )


async def _check_quotas(conn: AsyncConnection, admission: Admission) -> None:
    # The tenant row lock serializes this tenant's admissions, so two runs
    # cannot both squeeze under the same quota.
    tenant = (
        await conn.execute(
            sa.select(tenants.c.max_kv_blocks, tenants.c.max_concurrent_runs)
            .where(tenants.c.tenant_id == admission.tenant_id)
            .with_for_update()
        )
    ).first()
    if tenant is None:
        raise NotFound(f"tenant {admission.tenant_id} does not exist")
    open_blocks, open_runs = (
        await conn.execute(
            sa.select(
                sa.func.coalesce(sa.func.sum(kv_reservations.c.num_blocks), 0), sa.func.count()
            ).where(
                kv_reservations.c.tenant_id == admission.tenant_id,
                kv_reservations.c.released_at.is_(None),
            )
        )
    ).one()
    if tenant.max_kv_blocks and open_blocks + admission.num_blocks > tenant.max_kv_blocks:
        raise QuotaExceeded(
            f"KV quota: {open_blocks} of {tenant.max_kv_blocks} blocks reserved, this run needs {admission.num_blocks}",
            subject=f"tenant:{admission.tenant_id}:kv_blocks",
            retry_after=QUOTA_RETRY_SECONDS,
        )
    if tenant.max_concurrent_runs and open_runs >= tenant.max_concurrent_runs:
        raise QuotaExceeded(
            f"concurrency quota: {open_runs} of {tenant.max_concurrent_runs} runs in flight",
            subject=f"tenant:{admission.tenant_id}:concurrent_runs",
            retry_after=QUOTA_RETRY_SECONDS,
        )


async def find_by_idempotency_key(engine: AsyncEngine, tenant_id: str, key: str) -> RunView | None:
    async with engine.connect() as conn:
        row = (
            await conn.execute(
                sa.select(runs).where(runs.c.tenant_id == tenant_id, runs.c.idempotency_key == key)
            )
        ).first()
    return view_from_row(row._mapping) if row else None
