"""A worker whose engine process dies: the engine's runs end or go back to the queue, a
new engine starts, and the worker takes runs again once it has one. The worker is
`python -m services.worker` as the launcher runs it; the engine child is killed with
SIGKILL, and held still with SIGSTOP where a test needs a run that streamed nothing."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import psutil
import pytest

from services.core.event_store import EventStore
from services.core.requeue import MAX_REQUEUES
from services.core.runs import RunState, StoredEvent
from tests.services.processes import service_process
from tests.services.scheduler.helpers import wait_for
from tests.services.worker.running import assignment, leased_run, ready_engine, worker_env
from tollgate.v1 import worker_pb2, worker_pb2_grpc

WORKER_ID = "worker-1"


@pytest.fixture
async def worker(
    database_url: str, kafka_bootstrap: str, tiny_model_dir: Path
) -> AsyncIterator[tuple[psutil.Process, worker_pb2_grpc.WorkerServiceStub]]:
    env = worker_env(database_url, kafka_bootstrap, tiny_model_dir, TOLLGATE_WORKER_ID=WORKER_ID)
    async with service_process("worker", env) as (process, address):
        async with grpc.aio.insecure_channel(address) as channel:
            yield psutil.Process(process.pid), worker_pb2_grpc.WorkerServiceStub(channel)
        assert process.returncode is None  # the worker outlived its engines


async def events_of(store: EventStore, run_id: str) -> list[StoredEvent]:
    return await store.read(run_id)


async def ended(store: EventStore, run_id: str, kind: RunState) -> list[StoredEvent]:
    """The run's events once its last is `kind` at a seq after its latest lease."""
    events: list[StoredEvent] = await wait_for(lambda: _last_is(store, run_id, kind), timeout=30)
    return events


async def _last_is(store: EventStore, run_id: str, kind: RunState) -> list[StoredEvent] | None:
    events = await store.read(run_id)
    return events if events[-1].kind == kind and len(events) > 1 else None


async def test_a_dead_engine_fails_what_streamed_requeues_the_rest_and_is_replaced(
    store: EventStore, worker: tuple[psutil.Process, worker_pb2_grpc.WorkerServiceStub]
) -> None:
    process, stub = worker
    engine = await ready_engine(process, stub)
    streamed = await leased_run(store, WORKER_ID, max_tokens=900)
    await stub.AssignRun(streamed)

    async def has_streamed() -> bool:
        return any(e.kind == RunState.STREAMING for e in await store.read(streamed.run_id))

    await wait_for(has_streamed)
    engine.suspend()  # from here on the engine emits nothing
    unstarted = await leased_run(store, WORKER_ID, max_tokens=8)
    await stub.AssignRun(unstarted)
    await wait_for(lambda: _last_is(store, unstarted.run_id, RunState.PREFILL))
    engine.kill()

    events = await ended(store, streamed.run_id, RunState.FAILED)
    failed = events[-1]
    tokens = sum(len(e.payload["token_ids"]) for e in events if e.kind == RunState.STREAMING)
    assert failed.payload["code"] == "ENGINE_ERROR"
    assert failed.payload["usage"]["output_tokens"] == tokens > 0
    assert failed.payload["usage"]["prompt_tokens"] == 3
    requeued = await ended(store, unstarted.run_id, RunState.QUEUED)
    assert [e.kind for e in requeued] == [RunState.QUEUED, RunState.PREFILL, RunState.QUEUED]
    assert requeued[-1].payload["requeue_reason"] == "ENGINE_ERROR"
    assert requeued[-1].payload["prompt_token_ids"] == [1, 2, 3]

    # No engine yet: the worker has no room and says so.
    status = await stub.GetWorkerStatus(worker_pb2.GetWorkerStatusRequest())
    assert status.draining and status.num_free_blocks == 0 and not status.running_run_ids
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.AssignRun(assignment(unstarted.run_id, 8, last_seq=3))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

    await ready_engine(process, stub, dead_pid=engine.pid)
    epoch = await store.acquire_lease(unstarted.run_id, WORKER_ID)
    await stub.AssignRun(assignment(unstarted.run_id, 8, lease_epoch=epoch, last_seq=3))
    completed = await ended(store, unstarted.run_id, RunState.COMPLETED)
    assert completed[-1].payload["usage"]["output_tokens"] == 8


async def test_a_run_whose_engine_dies_four_times_ends_at_the_requeue_limit(
    store: EventStore, worker: tuple[psutil.Process, worker_pb2_grpc.WorkerServiceStub]
) -> None:
    process, stub = worker
    request = await leased_run(store, WORKER_ID, max_tokens=8)
    run_id, dead_pid = request.run_id, 0
    for attempt in range(MAX_REQUEUES + 1):
        engine = await ready_engine(process, stub, dead_pid)
        engine.suspend()  # the run is killed before it streams, like a request that kills
        last_seq = (await events_of(store, run_id))[-1].seq
        if attempt:
            epoch = await store.acquire_lease(run_id, WORKER_ID)
            request = assignment(run_id, 8, lease_epoch=epoch, last_seq=last_seq)
        await stub.AssignRun(request)
        engine.kill()
        dead_pid = engine.pid
        settled_after = last_seq + 1  # the attempt's `prefill`, then what settled it
        await wait_for(functools.partial(_after, store, run_id, settled_after), timeout=30)

    events = await events_of(store, run_id)
    kinds = [e.kind for e in events]
    assert kinds == [RunState.QUEUED] + [RunState.PREFILL, RunState.QUEUED] * MAX_REQUEUES + [
        RunState.PREFILL,
        RunState.FAILED,
    ]
    assert {e.payload.get("requeue_reason") for e in events[2:-1:2]} == {"ENGINE_ERROR"}
    assert events[-1].payload["code"] == "REQUEUE_LIMIT"
    assert events[-1].payload["usage"]["output_tokens"] == 0


async def _after(store: EventStore, run_id: str, seq: int) -> bool:
    return (await store.read(run_id))[-1].seq > seq
