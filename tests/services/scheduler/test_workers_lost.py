"""Worker registration, heartbeats, and what happens to the runs of a lost worker."""

import asyncio
import contextlib

import pytest

from services.core.event_store import EventStore, StaleLease
from services.core.runs import NewEvent, RunState
from tests.services.scheduler.fakes import FakeWorker
from tests.services.scheduler.helpers import heartbeats, queue_run, wait_for
from tollgate.v1 import scheduler_pb2


async def test_a_lost_workers_runs_are_requeued_or_failed(
    store: EventStore, start_scheduler, fake_workers
) -> None:
    lost = await fake_workers("lost", free_blocks=10)
    spare = await fake_workers("spare", free_blocks=0)
    scheduler = await start_scheduler({"lost": lost.address})
    beating = asyncio.create_task(heartbeats(scheduler, spare))
    try:
        unstarted = await queue_run(store)
        streamed = await queue_run(store)
        first = await wait_for(lambda: lost.assignment(unstarted))
        second = await wait_for(lambda: lost.assignment(streamed))

        # What the worker got done before it died.
        prefill = NewEvent(RunState.PREFILL, {"worker_id": "lost"})
        await store.append(unstarted, 1, [prefill], lease_epoch=first.lease_epoch)
        tokens = NewEvent(RunState.STREAMING, {"token_ids": [7, 8], "text": "hi"})
        await store.append(streamed, 1, [prefill, tokens], lease_epoch=second.lease_epoch)
        await lost.stop()
        spare.free_blocks = 10

        moved = await wait_for(lambda: spare.assignment(unstarted))
        events = await store.read(unstarted)
        kinds = [e.kind for e in events]
        assert kinds == [RunState.QUEUED, RunState.PREFILL, RunState.QUEUED]
        assert events[2].payload["requeue_reason"] == "WORKER_LOST"
        assert events[2].payload["prompt_token_ids"] == [1, 2, 3]
        assert moved.lease_epoch > first.lease_epoch
        assert moved.last_seq == 3

        failed = await wait_for(lambda: _last_event(store, streamed, RunState.FAILED))
        assert failed.seq == 4
        assert failed.payload["code"] == "WORKER_LOST"
        assert failed.payload["usage"]["output_tokens"] == 2
        assert failed.payload["usage"]["prompt_tokens"] == 3
        assert spare.assignment(streamed) is None  # never re-run after streaming

        # Should the lost worker come back, its lease is gone.
        with pytest.raises(StaleLease):
            await store.append(unstarted, 3, [prefill], lease_epoch=first.lease_epoch)
    finally:
        beating.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beating


async def _last_event(store: EventStore, run_id: str, kind: RunState):  # type: ignore[no-untyped-def]
    events = await store.read(run_id)
    return events[-1] if events and events[-1].kind == kind else None


async def test_registered_workers_count_and_unknown_heartbeats_are_told_to_register(
    start_scheduler, fake_workers
) -> None:
    worker = await fake_workers("w1", free_blocks=7)
    scheduler = await start_scheduler()
    unknown = await scheduler.stub.Heartbeat(scheduler_pb2.HeartbeatRequest(worker_id="w9"))
    assert not unknown.known

    beating = asyncio.create_task(heartbeats(scheduler, worker))
    try:
        stats = await wait_for(lambda: _stats_with_workers(scheduler, 1, free_blocks=7))
        assert stats.num_running == 0
    finally:
        beating.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beating
    await worker.stop()
    await wait_for(lambda: _stats_with_workers(scheduler, 0))


async def _stats_with_workers(scheduler, expected: int, free_blocks: int = 0):  # type: ignore[no-untyped-def]
    stats = await scheduler.stub.GetQueueStats(scheduler_pb2.GetQueueStatsRequest())
    wanted = (expected, free_blocks)
    return stats if (stats.num_workers, stats.num_free_blocks) == wanted else None


async def test_a_restarted_scheduler_adopts_running_runs_and_handles_their_loss(
    store: EventStore, start_scheduler, fake_workers
) -> None:
    # A run some worker started before this scheduler existed, and that worker is gone.
    run_id = await queue_run(store)
    epoch = await store.acquire_lease(run_id, "gone")
    await store.append(run_id, 1, [NewEvent(RunState.PREFILL, {})], lease_epoch=epoch)
    spare = await fake_workers("spare")
    await start_scheduler({"spare": spare.address})

    moved = await wait_for(lambda: spare.assignment(run_id))
    assert moved.last_seq == 3 and moved.lease_epoch > epoch


@pytest.mark.parametrize("rescan_seconds", [60.0, 0.2], ids=["kafka", "rescan"])
async def test_a_run_its_worker_handed_back_is_dispatched_again(
    store: EventStore, start_scheduler, fake_workers, rescan_seconds: float
) -> None:
    worker = await fake_workers("w1", free_blocks=10)
    scheduler = await start_scheduler({"w1": worker.address}, rescan_seconds=rescan_seconds)
    await wait_for(scheduler.app.trigger.ready.is_set)
    await wait_for(scheduler.app.relay.is_leader.is_set)
    run_id = await queue_run(store)
    first = await wait_for(lambda: worker.assignment(run_id))

    # What a worker whose engine died appends, under its lease, for a run that streamed nothing.
    requeued = NewEvent(
        RunState.QUEUED, {**(await store.read(run_id))[0].payload, "requeue_reason": "ENGINE_ERROR"}
    )
    prefill = NewEvent(RunState.PREFILL, {"worker_id": "w1"})
    await store.append(run_id, 1, [prefill, requeued], lease_epoch=first.lease_epoch)

    again = await wait_for(lambda: _assigned_after(worker, run_id, first.lease_epoch))
    assert again.last_seq == 3


def _assigned_after(worker: FakeWorker, run_id: str, lease_epoch: int):  # type: ignore[no-untyped-def]
    latest = worker.assignment(run_id)
    return latest if latest is not None and latest.lease_epoch > lease_epoch else None
