"""Runs the fleet cannot hold: the scheduler tells admission its largest pools, and a
queued run no live worker serving its model could ever hold ends `failed` REJECTED."""

import asyncio

from services.core.event_store import EventStore
from services.core.runs import RunState
from tests.services.scheduler.fakes import BLOCK_SIZE
from tests.services.scheduler.helpers import queue_run, wait_for
from tollgate.v1 import scheduler_pb2


async def test_queue_stats_name_the_largest_pool_per_model(start_scheduler, fake_workers) -> None:
    small = await fake_workers("small", free_blocks=64)
    large = await fake_workers("large", free_blocks=100)
    other = await fake_workers("other", free_blocks=64, model="other")
    workers = {w.worker_id: w.address for w in (small, large, other)}
    scheduler = await start_scheduler(workers)

    async def stats() -> scheduler_pb2.QueueStats | None:
        reply = await scheduler.stub.GetQueueStats(scheduler_pb2.GetQueueStatsRequest())
        return reply if len(reply.max_run_tokens) == 2 else None

    reply = await wait_for(stats)
    assert dict(reply.max_run_tokens) == {"tiny": 100 * BLOCK_SIZE, "other": 64 * BLOCK_SIZE}


async def test_a_queued_run_no_live_worker_can_hold_fails_after_the_grace(
    store: EventStore, start_scheduler, fake_workers
) -> None:
    worker = await fake_workers("w1", free_blocks=64)
    await start_scheduler({"w1": worker.address}, unfit_grace=0.5)
    fits = await queue_run(store, max_tokens=100)
    too_large = await queue_run(store, max_tokens=64 * BLOCK_SIZE)
    await wait_for(lambda: worker.assignment(fits))
    events = await wait_for(lambda: _ended(store, too_large))
    failed = events[-1]
    assert failed.kind == RunState.FAILED and failed.payload["code"] == "REJECTED"
    assert "largest pool holds 1024" in failed.payload["message"]
    assert worker.assignment(too_large) is None


async def test_a_run_whose_model_no_live_worker_serves_waits(
    store: EventStore, start_scheduler, fake_workers
) -> None:
    worker = await fake_workers("w1", free_blocks=64, model="other")
    scheduler = await start_scheduler({"w1": worker.address}, unfit_grace=0.2)
    run_id = await queue_run(store, max_tokens=64 * BLOCK_SIZE)
    await wait_for(lambda: run_id in scheduler.app.state.queued)
    await asyncio.sleep(1.0)
    assert [e.kind for e in await store.read(run_id)] == [RunState.QUEUED]


async def _ended(store: EventStore, run_id: str):  # type: ignore[no-untyped-def]
    events = await store.read(run_id)
    return events if events[-1].kind == RunState.FAILED else None
