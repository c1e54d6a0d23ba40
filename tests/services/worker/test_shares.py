"""A tenant's share of the worker: an interactive run of a tenant under its share that
does not fit has the youngest batch run of the tenant over its share suspended, and that
run goes on once blocks are free again, its tokens stored once each, none lost."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from services.core.event_store import EventStore
from services.core.runs import RunState, StoredEvent
from tests.services.scheduler.helpers import wait_for
from tests.services.worker.running import leased_run, running_worker
from tollgate.v1 import events_pb2, worker_pb2

WORKER_ID = "worker-1"
# With the prompt, 32 of the worker's 64 blocks each: two fill it.
FLOOD_TOKENS = 500
LIGHT_TOKENS = 40


async def test_a_light_tenants_run_suspends_the_floods_youngest_batch_run(
    store: EventStore, tiny_model_dir: Path
) -> None:
    async with running_worker(store, tiny_model_dir, worker_id=WORKER_ID) as worker:
        older = await leased_run(store, WORKER_ID, FLOOD_TOKENS, tenant_id="flood")
        younger = await leased_run(store, WORKER_ID, FLOOD_TOKENS, tenant_id="flood")
        younger.priority = events_pb2.PRIORITY_BATCH
        for request in (older, younger):
            await worker.stub.AssignRun(request)
        await wait_for(lambda: _streamed(store, younger.run_id))
        # The flood's own run, and the light tenant's batch run, suspend nothing.
        for tenant, priority in (("flood", "interactive"), ("light", "batch")):
            refused = await leased_run(store, WORKER_ID, LIGHT_TOKENS, tenant_id=tenant)
            refused.priority = events_pb2.PRIORITY_BATCH if priority == "batch" else 1
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await worker.stub.AssignRun(refused)
            assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        light = await leased_run(store, WORKER_ID, LIGHT_TOKENS, tenant_id="light")
        await worker.stub.AssignRun(light)
        status = await worker.stub.GetWorkerStatus(worker_pb2.GetWorkerStatusRequest())
        shares = {s.tenant_id: s for s in status.tenants}
        assert status.suspends_runs and status.num_free_blocks == 0
        assert (shares["flood"].num_runs, shares["flood"].num_suspended_runs) == (1, 1)
        assert (shares["light"].num_kv_blocks, shares["light"].num_runs) == (3, 1)
        ends = {}
        for run in (light, older, younger):
            ends[run.run_id] = await wait_for(lambda r=run: _ended(store, r.run_id), timeout=60)
    light_end = ends[light.run_id][-1].created_at
    assert ends[older.run_id][-1].created_at > light_end  # the older flood run went on meanwhile
    tokens = {run_id: _tokens(events) for run_id, events in ends.items()}
    # Greedy on the same prompt: the suspended run's tokens are the older's, once each.
    assert tokens[younger.run_id] == tokens[older.run_id]
    assert len(tokens[younger.run_id]) == FLOOD_TOKENS
    usage = ends[younger.run_id][-1].payload["usage"]
    assert (usage["prompt_tokens"], usage["output_tokens"]) == (3, FLOOD_TOKENS)


async def _streamed(store: EventStore, run_id: str) -> bool:
    return any(e.kind == RunState.STREAMING for e in await store.read(run_id))


async def _ended(store: EventStore, run_id: str) -> list[StoredEvent] | None:
    events = await store.read(run_id)
    return events if events[-1].kind == RunState.COMPLETED else None


def _tokens(events: list[StoredEvent]) -> list[int]:
    return [t for e in events if e.kind == RunState.STREAMING for t in e.payload["token_ids"]]
