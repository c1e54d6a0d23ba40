"""Schedulers as replicas: one leads, a follower takes over, leases are fenced."""

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator

import grpc
import pytest
import sqlalchemy as sa

from services.core.db import Database
from services.core.event_store import ConcurrencyConflict, EventStore, StaleLease
from services.core.runs import IllegalTransition, NewEvent, RunState
from services.scheduler.app import SCHEDULER_LOCK_KEY
from services.scheduler.scheduler_store import SchedulerStore
from tests.services.scheduler.fakes import FakeWorker
from tests.services.scheduler.helpers import heartbeats, queue_run, wait_for
from tollgate.v1 import scheduler_pb2

NUM_RUNS = 30
# From the leader's end to the follower leading: takeover_interval (0.5 s) and a margin.
TAKEOVER_BOUND_S = 2.0


async def test_of_two_leases_from_one_reading_only_the_first_is_granted(
    db: Database, store: EventStore
) -> None:
    scheduler_store = SchedulerStore(db)
    run_id = await queue_run(store)
    [run] = await scheduler_store.load_queued([run_id])

    first = await scheduler_store.lease_if_queued(run_id, "w1", run.last_seq, run.lease_epoch)
    second = await scheduler_store.lease_if_queued(run_id, "w2", run.last_seq, run.lease_epoch)

    assert first == (run.lease_epoch + 1, run.last_seq)
    assert second is None
    [again] = await scheduler_store.load_queued([run_id])
    assert again.lease_epoch == run.lease_epoch + 1  # read again, it may be leased again


async def test_two_leading_schedulers_start_no_run_twice_and_complete_all(
    store: EventStore, start_scheduler, fake_workers
) -> None:
    workers = [await fake_workers(f"w{i}", free_blocks=10_000) for i in range(2)]
    static = {w.worker_id: w.address for w in workers}
    # Both lead, as in the moment a partitioned leader has not noticed yet.
    for _ in range(2):
        await start_scheduler(static, lead=True)
    async with completing(store, workers) as started:
        run_ids = [await queue_run(store) for _ in range(NUM_RUNS)]
        for run_id in run_ids:
            await wait_for(lambda run_id=run_id: _has_ended(store, run_id), timeout=30)

    assert Counter(started) == Counter(run_ids)  # each started exactly once
    for run_id in run_ids:
        kinds = [e.kind for e in await store.read(run_id)]
        assert kinds == [RunState.QUEUED, RunState.PREFILL, RunState.COMPLETED]


async def test_only_the_leader_dispatches_and_a_follower_takes_over(
    store: EventStore, start_scheduler, fake_workers
) -> None:
    worker = await fake_workers("w1", free_blocks=10_000)
    schedulers = [await start_scheduler({"w1": worker.address}) for _ in range(2)]
    leader = await wait_for(lambda: _leader(schedulers))
    [follower] = [s for s in schedulers if s is not leader]
    await wait_for(leader.app.trigger.ready.is_set)
    before = await queue_run(store)
    await wait_for(lambda: leader.app.state.is_assigned(before))
    assert not follower.app.state.assignments and not follower.app.state.queued

    stopped = time.monotonic()
    await leader.stop()
    await wait_for(follower.app.leadership.is_leader.is_set, timeout=TAKEOVER_BOUND_S)
    assert time.monotonic() - stopped < TAKEOVER_BOUND_S
    # The new leader holds the run the old one assigned, and dispatches new runs.
    await wait_for(lambda: follower.app.state.is_assigned(before))
    after = await queue_run(store)
    assert (await wait_for(lambda: worker.assignment(after))).run_id == after


async def test_a_leader_whose_session_ends_stops_leading_at_once_and_competes_again(
    db: Database, start_scheduler
) -> None:
    scheduler = await start_scheduler()
    await wait_for(scheduler.app.leadership.is_leader.is_set)
    ended = time.monotonic()
    async with db.connect() as conn:
        # As when the network or the server drops the leader's connection.
        await conn.execute(_END_LOCK_SESSION, {"key": SCHEDULER_LOCK_KEY})
        await conn.commit()
    await wait_for(lambda: not scheduler.app.leadership.is_leader.is_set(), timeout=3)
    assert time.monotonic() - ended < TAKEOVER_BOUND_S
    await wait_for(scheduler.app.leadership.is_leader.is_set, timeout=10)


_END_LOCK_SESSION = sa.text(
    "SELECT pg_terminate_backend(pid) FROM pg_locks"
    " WHERE locktype = 'advisory' AND granted AND classid = 0 AND objid = :key"
)


async def test_a_follower_drops_hints_and_cancels_from_the_projection(
    store: EventStore, start_scheduler
) -> None:
    schedulers = [await start_scheduler() for _ in range(2)]
    leader = await wait_for(lambda: _leader(schedulers))
    [follower] = [s for s in schedulers if s is not leader]
    run_id = await queue_run(store)

    hinted = await follower.stub.RunsQueued(scheduler_pb2.RunsQueuedRequest(run_ids=[run_id]))
    assert hinted.num_taken == 0
    cancel = scheduler_pb2.SchedulerCancelRunRequest(run_id=run_id, reason="user")
    assert (await follower.stub.CancelRun(cancel)).found
    assert (await store.get_run(run_id)).state == RunState.CANCELLED  # type: ignore[union-attr]


async def test_after_a_takeover_a_worker_gets_time_to_register_with_the_new_leader(
    store: EventStore, start_scheduler, fake_workers
) -> None:
    worker = await fake_workers("w1", free_blocks=10)
    schedulers = [await start_scheduler(worker_timeout=1.5) for _ in range(2)]
    leader = await wait_for(lambda: _leader(schedulers))
    [follower] = [s for s in schedulers if s is not leader]
    async with beating(leader, worker):  # the worker knows only the leader
        run_id = await queue_run(store)
        assignment = await wait_for(lambda: worker.assignment(run_id))
        tokens = NewEvent(RunState.STREAMING, {"token_ids": [7], "text": "a"})
        prefill = NewEvent(RunState.PREFILL, {"worker_id": "w1"})
        await store.append(run_id, 1, [prefill, tokens], lease_epoch=assignment.lease_epoch)
    # Heartbeats stopped first: a beat on the stopped leader's closed channel fails, but not
    # with an RPC error.
    await leader.stop()
    await wait_for(follower.app.leadership.is_leader.is_set, timeout=TAKEOVER_BOUND_S)
    await wait_for(lambda: follower.app.state.is_assigned(run_id))
    # It reaches the new leader a heartbeat later; its run must not be counted lost meanwhile.
    await asyncio.sleep(0.5)
    async with beating(follower, worker):
        await asyncio.sleep(3.0)  # twice the worker timeout
        run = await store.get_run(run_id)
    assert run is not None and run.state == RunState.STREAMING


async def test_a_live_worker_id_registered_from_another_address_is_refused(
    start_scheduler,
) -> None:
    scheduler = await start_scheduler()
    register = scheduler_pb2.RegisterWorkerRequest(
        worker_id="w1", address="127.0.0.1:7001", model="tiny"
    )
    await scheduler.stub.RegisterWorker(register)
    await scheduler.stub.RegisterWorker(register)  # the same worker again: fine

    impostor = scheduler_pb2.RegisterWorkerRequest(
        worker_id="w1", address="127.0.0.1:7002", model="tiny"
    )
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await scheduler.stub.RegisterWorker(impostor)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "127.0.0.1:7001" in (refused.value.details() or "")


def _leader(schedulers):  # type: ignore[no-untyped-def]
    leading = [s for s in schedulers if s.app.leadership.is_leader.is_set()]
    return leading[0] if len(leading) == 1 else None


async def _has_ended(store: EventStore, run_id: str) -> bool:
    run = await store.get_run(run_id)
    return run is not None and run.state == RunState.COMPLETED


@contextlib.asynccontextmanager
async def beating(scheduler, worker: FakeWorker) -> AsyncIterator[None]:  # type: ignore[no-untyped-def]
    task = asyncio.create_task(heartbeats(scheduler, worker))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await task


@contextlib.asynccontextmanager
async def completing(store: EventStore, workers: list[FakeWorker]) -> AsyncIterator[list[str]]:
    """Has the fake workers run what they are assigned, as a real worker appends: prefill,
    then completed, under the lease. Yields the run ids whose prefill was accepted."""
    started: list[str] = []

    async def run_assigned() -> None:
        done = 0
        while True:
            assigned = [a for w in workers for a in w.assigned]
            for assignment in assigned[done:]:
                await _run(store, assignment, started)
            done = len(assigned)
            await asyncio.sleep(0.01)

    task = asyncio.create_task(run_assigned())
    try:
        yield started
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _run(store: EventStore, assignment, started: list[str]) -> None:  # type: ignore[no-untyped-def]
    epoch, seq = assignment.lease_epoch, assignment.last_seq
    prefill = NewEvent(RunState.PREFILL, {"worker_id": "fake", "lease_epoch": epoch})
    try:
        await store.append(assignment.run_id, seq, [prefill], lease_epoch=epoch)
    except (StaleLease, ConcurrencyConflict, IllegalTransition):
        return  # fenced off: another lease holds the run
    started.append(assignment.run_id)
    completed = NewEvent(RunState.COMPLETED, {"finish_reason": "length", "usage": {}})
    await store.append(assignment.run_id, seq + 1, [completed], lease_epoch=epoch)
