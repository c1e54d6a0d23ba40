"""Builders for tenants, keys and runs, written straight to the database."""

from __future__ import annotations

import uuid
from typing import Any

import sqlalchemy as sa

from services.core.auth import new_key
from services.core.db import Database
from services.core.event_store import EventStore
from services.core.runs import NewEvent, NewRun, RunState
from services.core.schema import api_keys, kv_reservations, ledger_entries, runs, tenants


async def create_tenant(db: Database, tenant_id: str | None = None) -> tuple[str, str]:
    """A tenant and one API key for it: (tenant_id, key)."""
    tenant_id = tenant_id or f"tenant-{uuid.uuid4().hex[:8]}"
    key = new_key()
    async with db.begin() as conn:
        await conn.execute(tenants.insert().values(tenant_id=tenant_id, name=tenant_id))
        await conn.execute(
            api_keys.insert().values(
                key_id=key.key_id, tenant_id=tenant_id, secret_hash=key.secret_hash
            )
        )
    return tenant_id, key.secret


def usage(prompt: int = 10, cached: int = 4, output: int = 5) -> dict[str, int | float]:
    return {
        "prompt_tokens": prompt,
        "cached_prompt_tokens": cached,
        "output_tokens": output,
        "kv_blocks_peak": 2,
        "kv_block_seconds": 0.4,
    }


async def queued_run(
    store: EventStore, tenant_id: str = "t1", model: str = "tiny", priority: str = "interactive"
) -> str:
    """A queued run holding a KV reservation, as admission leaves it."""
    run_id = str(uuid.uuid4())
    await store.append(
        run_id,
        0,
        [NewEvent(RunState.QUEUED, {"model": model, "prompt_token_ids": [1, 2, 3]})],
        new_run=NewRun(
            tenant_id=tenant_id, model=model, priority=priority, idempotency_key=f"run:{run_id}"
        ),
    )
    async with store.db.begin() as conn:
        await conn.execute(
            kv_reservations.insert().values(run_id=run_id, tenant_id=tenant_id, num_kv_blocks=4)
        )
    return run_id


async def terminal_run(
    store: EventStore,
    tenant_id: str = "t1",
    *,
    kind: RunState = RunState.COMPLETED,
    run_usage: dict[str, int | float] | None = None,
    model: str = "tiny",
    priority: str = "interactive",
) -> str:
    """A run that went queued → prefill → streaming → `kind`, not yet billed; it streamed
    as many tokens as its usage says."""
    run_id = await queued_run(store, tenant_id, model, priority)
    run_usage = run_usage or usage()
    payload: dict[str, Any] = {"usage": run_usage}
    if kind == RunState.COMPLETED:
        payload["finish_reason"] = "length"
    else:
        payload["reason" if kind == RunState.CANCELLED else "code"] = "TEST"
    await store.append(
        run_id,
        1,
        [
            NewEvent(RunState.PREFILL),
            NewEvent(
                RunState.STREAMING,
                {"token_ids": _tokens(run_usage.get("output_tokens")), "text": "hi"},
            ),
            NewEvent(kind, payload),
        ],
    )
    return run_id


def _tokens(output_tokens: object) -> list[int]:
    """As many tokens as `output_tokens` says; two where it says no number."""
    return list(range(output_tokens if isinstance(output_tokens, int) else 2))


async def entry_count(db: Database, run_id: str | None = None) -> int:
    query = sa.select(sa.func.count()).select_from(ledger_entries)
    if run_id is not None:
        query = query.where(ledger_entries.c.run_id == run_id)
    async with db.connect() as conn:
        return int(await conn.scalar(query) or 0)


async def open_reservations(db: Database) -> int:
    async with db.connect() as conn:
        count = await conn.scalar(
            sa.select(sa.func.count())
            .select_from(kv_reservations)
            .where(kv_reservations.c.released_at.is_(None))
        )
    return int(count or 0)


async def age_runs(db: Database, seconds: float) -> None:
    """Moves every run's last update `seconds` into the past, past the sweep's grace."""
    async with db.begin() as conn:
        await conn.execute(
            runs.update().values(
                updated_at=runs.c.updated_at - sa.text(f"interval '{float(seconds)} seconds'")
            )
        )
