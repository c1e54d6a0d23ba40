"""An AssignRun under a newer lease for a run the worker still holds under an older one:
the scheduler took the run back and hands it out again. The worker drops its old attempt
and says so (UNAVAILABLE, retry), then takes the run afresh under the newer lease."""

from __future__ import annotations

from pathlib import Path

import grpc
import psutil
import pytest

from services.core.event_store import EventStore
from services.core.runs import NewEvent, RunState, StoredEvent
from tests.services.scheduler.helpers import wait_for
from tests.services.worker.running import assignment, engine_of, leased_run, running_worker

WORKER_ID = "worker-1"
MAX_TOKENS = 40


async def test_a_newer_lease_for_a_held_run_drops_the_old_attempt_and_starts_it_anew(
    store: EventStore, tiny_model_dir: Path
) -> None:
    async with running_worker(store, tiny_model_dir, worker_id=WORKER_ID) as worker:
        engine = engine_of(psutil.Process())
        assert engine is not None
        first = await leased_run(store, WORKER_ID, max_tokens=MAX_TOKENS)
        run_id = first.run_id
        engine.suspend()  # the old attempt stores its prefill and nothing more
        try:
            await worker.stub.AssignRun(first)
            await wait_for(lambda: _num_events(store, run_id, 2))
            # What the scheduler does with a run it believes its worker no longer holds.
            epoch = await store.acquire_lease(run_id, "scheduler")
            queued = (await store.read(run_id))[0]
            requeued = NewEvent(
                RunState.QUEUED, {**queued.payload, "requeue_reason": "WORKER_LOST"}
            )
            await store.append(run_id, 2, [requeued], lease_epoch=epoch)
            newer = await store.acquire_lease(run_id, WORKER_ID)
            again = assignment(run_id, MAX_TOKENS, lease_epoch=newer, last_seq=3)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await worker.stub.AssignRun(again)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            engine.resume()
        await wait_for(lambda: _assigned(worker.stub, again))
        events: list[StoredEvent] = await wait_for(lambda: _ended(store, run_id), timeout=30)
    kinds = [e.kind for e in events]
    assert kinds[:4] == ["queued", "prefill", "queued", "prefill"]
    assert events[3].payload["lease_epoch"] == newer
    assert kinds[-1] == "completed"
    streamed = sum(len(e.payload["token_ids"]) for e in events if e.kind == "streaming")
    assert streamed == MAX_TOKENS  # from the new attempt only


async def _num_events(store: EventStore, run_id: str, num: int) -> bool:
    return len(await store.read(run_id)) == num


async def _assigned(stub, request) -> bool:  # type: ignore[no-untyped-def]
    try:
        await stub.AssignRun(request)
    except grpc.aio.AioRpcError as error:
        if error.code() != grpc.StatusCode.UNAVAILABLE:
            raise
        return False
    return True


async def _ended(store: EventStore, run_id: str) -> list[StoredEvent] | None:
    events = await store.read(run_id)
    return events if events[-1].kind == RunState.COMPLETED else None
