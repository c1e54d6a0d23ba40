"""Builders and waits shared by the scheduler tests."""

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from services.core.db import Database
from services.core.event_store import EventStore
from services.core.runs import NewEvent, NewRun, RunState
from services.core.schema import tenants
from tests.services.scheduler.fakes import BLOCK_SIZE, FakeWorker
from tollgate.v1 import scheduler_pb2

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


async def add_tenant(db: Database, tenant_id: str, weight: int = 1) -> None:
    async with db.begin() as conn:
        await conn.execute(
            sa.insert(tenants).values(tenant_id=tenant_id, name=tenant_id, weight=weight)
        )


async def queue_run(
    store: EventStore,
    tenant_id: str = "t1",
    *,
    priority: str = "interactive",
    max_tokens: int = 13,
    prompt: tuple[int, ...] = (1, 2, 3),
) -> str:
    """Appends a `queued` event as admission does; returns the run id."""
    run_id = str(uuid.uuid4())
    payload = {
        "model": "tiny",
        "priority": f"PRIORITY_{priority.upper()}",
        "sampling": {"temperature": 0.0, "max_tokens": max_tokens},
        "prompt_token_ids": list(prompt),
        "idempotency_key": f"run:{run_id}",
        "num_kv_blocks": -(-(len(prompt) + max_tokens) // BLOCK_SIZE),
    }
    await store.append(
        run_id,
        0,
        [NewEvent(RunState.QUEUED, payload)],
        new_run=NewRun(tenant_id, "tiny", priority, f"run:{run_id}"),
        traceparent=TRACEPARENT,
    )
    return run_id


async def wait_for(
    predicate: Callable[[], Any], timeout: float = 15, interval: float = 0.05
) -> Any:
    """Polls `predicate` (sync or async) until it returns something truthy; returns that."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(interval)


async def heartbeats(scheduler, worker: FakeWorker) -> None:  # type: ignore[no-untyped-def]
    """What a real worker does: register, then heartbeat; register again when forgotten."""
    register = scheduler_pb2.RegisterWorkerRequest(
        worker_id=worker.worker_id, address=worker.address, model=worker.model
    )
    reply = await scheduler.stub.RegisterWorker(register)
    while True:
        beat = await scheduler.stub.Heartbeat(
            scheduler_pb2.HeartbeatRequest(
                worker_id=worker.worker_id,
                num_free_blocks=worker.free_blocks,
                running_run_ids=worker.running(),
            )
        )
        if not beat.known:
            await scheduler.stub.RegisterWorker(register)
        await asyncio.sleep(reply.heartbeat_interval_seconds)
