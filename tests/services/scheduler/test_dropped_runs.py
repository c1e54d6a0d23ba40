"""Runs a live worker no longer holds (it restarted, or dropped them): re-queued under a
new lease if they emitted nothing, `failed` WORKER_LOST if they streamed, within two
heartbeat intervals and long before the worker timeout, which never fires here."""

import asyncio
import contextlib
import time

from services.core.event_store import EventStore
from services.core.requeue import MAX_REQUEUES
from services.core.runs import NewEvent, RunState, StoredEvent
from tests.services.scheduler.fakes import FakeWorker
from tests.services.scheduler.helpers import queue_run, wait_for
from tests.services.scheduler.test_workers_lost import heartbeats
from tollgate.v1 import scheduler_pb2

HEARTBEAT_S = 0.2
# The worker timeout stays far away: only the reports can tell the scheduler.
TIMINGS = {"heartbeat_interval": HEARTBEAT_S, "worker_timeout": 60.0}


async def test_a_restarted_worker_s_runs_are_requeued_or_failed(
    store: EventStore, start_scheduler, fake_workers
) -> None:
    worker = await fake_workers("w1", free_blocks=20)
    await start_scheduler({"w1": worker.address}, **TIMINGS)
    unstarted, prefilled, streamed = [await queue_run(store) for _ in range(3)]
    leases = {r: await wait_for(lambda r=r: worker.assignment(r)) for r in (prefilled, streamed)}
    first = await wait_for(lambda: worker.assignment(unstarted))
    # What the worker stored before it restarted; `unstarted` never got its prefill.
    prefill = NewEvent(RunState.PREFILL, {"worker_id": "w1"})
    tokens = NewEvent(RunState.STREAMING, {"token_ids": [7, 8], "text": "hi"})
    await store.append(prefilled, 1, [prefill], lease_epoch=leases[prefilled].lease_epoch)
    await store.append(streamed, 1, [prefill, tokens], lease_epoch=leases[streamed].lease_epoch)

    worker.restart()
    restarted_at = time.monotonic()
    failed = await wait_for(lambda: _last_is(store, streamed, RunState.FAILED))
    again = await wait_for(lambda: _assigned_after(worker, unstarted, first.lease_epoch))
    await wait_for(lambda: _assigned_after(worker, prefilled, leases[prefilled].lease_epoch))
    settled_in = time.monotonic() - restarted_at

    assert failed[-1].payload["code"] == "WORKER_LOST"
    assert failed[-1].payload["usage"]["output_tokens"] == 2
    assert [e.kind for e in await store.read(prefilled)] == ["queued", "prefill", "queued"]
    # The attempt that never stored its prefill counts too.
    requeued = await store.read(unstarted)
    assert [e.kind for e in requeued] == ["queued", "prefill", "queued"]
    assert requeued[-1].payload["requeue_reason"] == "WORKER_LOST"
    assert again.last_seq == 3
    assert settled_in < 10 * HEARTBEAT_S  # two intervals, and room for a busy machine


async def test_a_run_that_takes_down_every_worker_before_its_prefill_hits_the_requeue_limit(
    store: EventStore, start_scheduler, fake_workers
) -> None:
    worker = await fake_workers("w1", free_blocks=20)
    worker.drops_runs = True
    await start_scheduler({"w1": worker.address}, **TIMINGS)
    run_id = await queue_run(store)
    events = await wait_for(lambda: _last_is(store, run_id, RunState.FAILED), timeout=30)
    assert events[-1].payload["code"] == "REQUEUE_LIMIT"
    assert len(worker.dropped) == MAX_REQUEUES + 1


async def test_a_registered_worker_s_heartbeats_report_its_runs_and_its_draining(
    store: EventStore, start_scheduler, fake_workers
) -> None:
    worker = await fake_workers("w1", free_blocks=20)
    scheduler = await start_scheduler(**TIMINGS)
    beating = asyncio.create_task(heartbeats(scheduler, worker))
    try:
        run_id = await queue_run(store)
        first = await wait_for(lambda: worker.assignment(run_id))
        await asyncio.sleep(5 * HEARTBEAT_S)  # held: nothing happens to it
        assert worker.assignment(run_id) == first
        worker.dropped.append(run_id)
        await wait_for(lambda: _assigned_after(worker, run_id, first.lease_epoch))

        beat = scheduler_pb2.HeartbeatRequest(
            worker_id="w1", num_free_blocks=20, draining=True, boot_id=worker.boot_id
        )
        beating.cancel()
        await scheduler.stub.Heartbeat(beat)
        registered = scheduler.app.state.registry.get("w1")
        assert registered is not None and registered.draining
    finally:
        beating.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beating


async def _last_is(store: EventStore, run_id: str, kind: RunState) -> list[StoredEvent] | None:
    events = await store.read(run_id)
    return events if events[-1].kind == kind else None


def _assigned_after(worker: FakeWorker, run_id: str, lease_epoch: int):  # type: ignore[no-untyped-def]
    latest = worker.assignment(run_id)
    return latest if latest is not None and latest.lease_epoch > lease_epoch else None
