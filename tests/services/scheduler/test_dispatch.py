"""Scheduler against real PostgreSQL and Kafka, with fake workers."""

import asyncio
import time

import grpc

from services.core.db import Database, open_db
from services.core.event_store import EventStore
from services.core.runs import NewEvent, RunState
from services.scheduler.dispatcher import Dispatcher
from services.scheduler.scheduler_store import SchedulerStore
from services.scheduler.state import SchedulerState
from services.scheduler.worker_client import AssignOutcome, AssignResult
from services.scheduler.workers import WorkerRegistry, WorkerReport
from services.stack.infra import free_port
from tests.services.scheduler.fakes import BLOCK_SIZE
from tests.services.scheduler.helpers import TRACEPARENT, queue_run, wait_for
from tollgate.v1 import events_pb2, scheduler_pb2


async def stats(scheduler) -> scheduler_pb2.QueueStats:  # type: ignore[no-untyped-def]
    return await scheduler.stub.GetQueueStats(scheduler_pb2.GetQueueStatsRequest())


async def test_a_queued_run_is_assigned_under_its_lease_and_last_seq(
    store: EventStore, start_scheduler, fake_workers
) -> None:
    worker = await fake_workers("w1")
    scheduler = await start_scheduler({"w1": worker.address})
    run_id = await queue_run(store, "tenant-a", max_tokens=13)

    request = await wait_for(lambda: worker.assignment(run_id))
    run = await store.get_run(run_id)
    assert run is not None and run.owner == "w1"
    assert request.lease_epoch == run.lease_epoch >= 1
    assert request.last_seq == 1
    assert request.tenant_id == request.cache_namespace == "tenant-a"
    assert request.tenant_weight == 1  # the weight of a tenant created without one
    assert request.model == "tiny"
    assert list(request.prompt_token_ids) == [1, 2, 3]
    assert request.sampling.max_tokens == 13 and request.sampling.HasField("temperature")
    assert request.priority == events_pb2.PRIORITY_INTERACTIVE
    assert request.traceparent == TRACEPARENT

    now = await stats(scheduler)
    assert (now.num_interactive, now.num_batch, now.num_running, now.num_workers) == (0, 0, 1, 1)
    [load] = now.workers
    assert (load.worker_id, load.num_running, load.alive) == ("w1", 1, True)
    assert 0 <= load.num_free_blocks <= load.num_total_blocks or load.num_total_blocks == 0
    await asyncio.sleep(0.5)
    assert len(worker.assigned) == 1  # assigned once, whatever rescans found meanwhile

    # The run ends: its assignment ends with it.
    await store.append(run_id, 1, [NewEvent(RunState.PREFILL, {"worker_id": "w1"})])
    await store.append(run_id, 2, [NewEvent(RunState.COMPLETED, {"finish_reason": "stop"})])
    await wait_for(lambda: _num_running_is(scheduler, 0))


async def _num_running_is(scheduler, expected: int) -> bool:  # type: ignore[no-untyped-def]
    return (await stats(scheduler)).num_running == expected


async def test_interactive_runs_are_dispatched_before_batch(
    store: EventStore, start_scheduler, fake_workers
) -> None:
    worker = await fake_workers("w1", free_blocks=0)
    scheduler = await start_scheduler({"w1": worker.address})
    batch = await queue_run(store, "t1", priority="batch")
    await asyncio.sleep(0.05)
    interactive = await queue_run(store, "t1", priority="interactive")
    await wait_for(lambda: _queued_are(scheduler, interactive=1, batch=1))

    worker.free_blocks = 1  # room for one run
    await wait_for(lambda: worker.assigned)
    await asyncio.sleep(0.5)
    assert [r.run_id for r in worker.assigned] == [interactive]

    worker.free_blocks += 1
    await wait_for(lambda: len(worker.assigned) == 2)
    assert [r.run_id for r in worker.assigned] == [interactive, batch]
    assert worker.assigned[1].priority == events_pb2.PRIORITY_BATCH


async def _queued_are(scheduler, *, interactive: int, batch: int) -> bool:  # type: ignore[no-untyped-def]
    now = await stats(scheduler)
    return (now.num_interactive, now.num_batch) == (interactive, batch)


async def test_workers_without_room_are_skipped(
    store: EventStore, start_scheduler, fake_workers
) -> None:
    small = await fake_workers("small", free_blocks=1)
    liar = await fake_workers("liar", free_blocks=100)  # reports room, refuses anyway
    liar.reject = True
    big = await fake_workers("big", free_blocks=8)
    workers = {w.worker_id: w.address for w in (small, liar, big)}
    scheduler = await start_scheduler(workers)
    await wait_for(lambda: _workers_are(scheduler, 3))

    run_id = await queue_run(store, max_tokens=61)  # 64 tokens: 4 blocks
    await wait_for(lambda: big.assignment(run_id))
    assert liar.rejected == [run_id]
    assert not small.assigned and not liar.assigned
    run = await store.get_run(run_id)
    assert run is not None and run.owner == "big"
    assert big.assigned[0].lease_epoch == run.lease_epoch == 2  # the liar's lease came first


async def test_a_run_every_worker_refuses_ends_failed(
    store: EventStore, start_scheduler, fake_workers
) -> None:
    worker = await fake_workers("w1")
    worker.refuse_with = grpc.StatusCode.INVALID_ARGUMENT
    await start_scheduler({"w1": worker.address})
    run_id = await queue_run(store)

    failed = await wait_for(lambda: _ended(store, run_id))
    assert failed.kind == RunState.FAILED
    assert failed.payload["code"] == "REJECTED"
    assert "cannot run this" in failed.payload["message"]
    assert worker.rejected == [run_id] * 3


async def _ended(store: EventStore, run_id: str):  # type: ignore[no-untyped-def]
    events = await store.read(run_id)
    return events[-1] if events[-1].kind != RunState.QUEUED else None


async def _workers_are(scheduler, expected: int) -> bool:  # type: ignore[no-untyped-def]
    return (await stats(scheduler)).num_workers == expected


async def test_cancel_of_a_queued_run_appends_cancelled_and_it_never_runs(
    store: EventStore, start_scheduler, fake_workers
) -> None:
    worker = await fake_workers("w1", free_blocks=0)
    scheduler = await start_scheduler({"w1": worker.address})
    run_id = await queue_run(store, prompt=(5, 6, 7, 8))
    await wait_for(lambda: _queued_are(scheduler, interactive=1, batch=0))

    reply = await scheduler.stub.CancelRun(
        scheduler_pb2.SchedulerCancelRunRequest(run_id=run_id, reason="client asked")
    )
    assert reply.found
    events = await store.read(run_id)
    assert [e.kind for e in events] == [RunState.QUEUED, RunState.CANCELLED]
    assert events[-1].payload == {"reason": "client asked", "usage": {"prompt_tokens": 4}}

    worker.free_blocks = 10
    await asyncio.sleep(1.0)  # several rescans and dispatch rounds
    assert not worker.assigned
    assert await _queued_are(scheduler, interactive=0, batch=0)

    again = scheduler_pb2.SchedulerCancelRunRequest(run_id=run_id)
    assert not (await scheduler.stub.CancelRun(again)).found
    unknown = scheduler_pb2.SchedulerCancelRunRequest(run_id="no-such-run")
    assert not (await scheduler.stub.CancelRun(unknown)).found


async def test_cancel_of_an_assigned_run_goes_to_its_worker(
    store: EventStore, start_scheduler, fake_workers
) -> None:
    worker = await fake_workers("w1")
    scheduler = await start_scheduler({"w1": worker.address})
    run_id = await queue_run(store)
    await wait_for(lambda: worker.assignment(run_id))

    reply = await scheduler.stub.CancelRun(
        scheduler_pb2.SchedulerCancelRunRequest(run_id=run_id, reason="stop")
    )
    assert reply.found
    assert worker.cancelled == [run_id]
    assert [e.kind for e in await store.read(run_id)] == [RunState.QUEUED]  # the worker appends


class _NoRoom:
    """Worker clients whose every AssignRun is answered RESOURCE_EXHAUSTED."""

    def __init__(self) -> None:
        self.calls = 0

    async def assign(self, address: str, run: object, grant: object) -> AssignResult:
        self.calls += 1
        return AssignResult(AssignOutcome.NO_ROOM, "no room")


async def test_a_no_room_answer_keeps_the_worker_full_until_it_reports_again(
    store: EventStore, db: Database
) -> None:
    registry = WorkerRegistry()
    registry.add_static("w1", "127.0.0.1:1")
    registry.observe(
        "w1", WorkerReport(num_free_blocks=8, model="tiny", num_total_blocks=64), time.monotonic()
    )
    state = SchedulerState(registry)
    scheduler_store = SchedulerStore(db, BLOCK_SIZE)
    [run] = await scheduler_store.load_queued([await queue_run(store)])
    state.enqueue(run)
    clients = _NoRoom()
    dispatcher = Dispatcher(state, store, scheduler_store, clients)  # type: ignore[arg-type]

    assert await dispatcher.dispatch_one()
    # The run is queued again, and nothing fits the worker until it says otherwise.
    assert run.run_id in state.queued
    assert not await dispatcher.dispatch_one()
    assert clients.calls == 1
    registry.observe(
        "w1", WorkerReport(num_free_blocks=8, model="tiny", num_total_blocks=64), time.monotonic()
    )
    assert await dispatcher.dispatch_one()
    assert clients.calls == 2


def _one_worker(num_free_blocks: int) -> WorkerRegistry:
    registry = WorkerRegistry()
    registry.add_static("w1", "127.0.0.1:1")
    report = WorkerReport(num_free_blocks=num_free_blocks, model="tiny", num_total_blocks=64)
    registry.observe("w1", report, time.monotonic())
    return registry


class _CountedStore(SchedulerStore):
    num_leases = 0

    async def lease_if_queued(self, run_id: str, owner: str, last_seq: int, lease_epoch: int):  # type: ignore[no-untyped-def]
        self.num_leases += 1
        return await super().lease_if_queued(run_id, owner, last_seq, lease_epoch)


async def test_while_the_database_is_away_the_dispatcher_backs_off(
    store: EventStore, db: Database
) -> None:
    state = SchedulerState(_one_worker(num_free_blocks=64))
    [run] = await SchedulerStore(db, BLOCK_SIZE).load_queued([await queue_run(store)])
    state.enqueue(run)
    away = open_db(f"postgresql://postgres@127.0.0.1:{free_port()}/gone", pool_size=1)
    scheduler_store = _CountedStore(away, BLOCK_SIZE)
    dispatcher = Dispatcher(state, store, scheduler_store, _NoRoom())  # type: ignore[arg-type]
    task = asyncio.create_task(dispatcher.run())
    try:
        await asyncio.sleep(2.0)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await away.dispose()
    # 0.1 + 0.2 + 0.4 + 0.8 s of pauses, not a lease attempt per turn of the loop.
    assert 2 <= scheduler_store.num_leases <= 6
    assert dispatcher.backoff >= 0.4
    assert run.run_id in state.queued
