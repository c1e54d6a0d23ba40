"""FakeWorker answers as the real worker does, on what the scheduler relies on.

`WorkerContractTests` talks to a WorkerService through its stub only; one subclass runs
it against FakeWorker, the other against the real WorkerServicer over WorkerCore and the
tiny model. What FakeWorker scripts beyond that (`reject`, `refuse_with`) is not part of it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from services.core.db import open_db
from services.core.event_store import EventStore
from tests.services.scheduler.fakes import FakeWorker
from tests.services.worker.running import BLOCK_SIZE, PROMPT, assignment, leased_run, running_worker
from tollgate.v1 import worker_pb2, worker_pb2_grpc

WORKER_ID = "worker-1"
NUM_BLOCKS = 64
LONG_RUN = 900  # tokens: 57 blocks, and a run that lasts while a test looks at it
TOO_LONG_RUN = 1100  # 69 blocks: more than the worker has


@dataclass
class WorkerSide:
    stub: worker_pb2_grpc.WorkerServiceStub
    # The AssignRun the scheduler would send for a new run of `max_tokens`.
    new_assignment: Callable[[int], Awaitable[worker_pb2.AssignRunRequest]]

    async def status(self) -> worker_pb2.WorkerStatus:
        return await self.stub.GetWorkerStatus(worker_pb2.GetWorkerStatusRequest())

    async def cancel(self, run_id: str) -> bool:
        request = worker_pb2.CancelAssignedRunRequest(run_id=run_id, reason="test")
        return (await self.stub.CancelAssignedRun(request)).found


def blocks_for(max_tokens: int) -> int:
    return -(-(len(PROMPT) + max_tokens) // BLOCK_SIZE)


async def eventually(condition: Callable[[], Awaitable[bool]], timeout: float = 15.0) -> bool:
    async with asyncio.timeout(timeout):
        while not await condition():
            await asyncio.sleep(0.05)
    return True


class WorkerContractTests:
    """Subclasses provide a `worker` fixture: a WorkerSide with NUM_BLOCKS blocks free."""

    async def test_an_idle_worker_reports_its_model_and_blocks(self, worker: WorkerSide) -> None:
        status = await worker.status()
        assert (status.worker_id, status.model, status.block_size) == (WORKER_ID, "tiny", 16)
        assert status.boot_id  # what tells the scheduler the process restarted
        assert status.num_free_blocks == status.num_total_blocks == NUM_BLOCKS
        assert list(status.running_run_ids) == [] and not status.draining

    async def test_an_assignment_that_fits_is_accepted_and_holds_its_blocks(
        self, worker: WorkerSide
    ) -> None:
        request = await worker.new_assignment(LONG_RUN)
        reply = await worker.stub.AssignRun(request)
        assert reply.worker_id == WORKER_ID
        status = await worker.status()
        assert request.run_id in status.running_run_ids
        assert status.num_free_blocks == NUM_BLOCKS - blocks_for(LONG_RUN)
        assert 0 <= status.num_free_blocks <= status.num_total_blocks
        assert await worker.cancel(request.run_id)

    async def test_an_assignment_that_does_not_fit_is_resource_exhausted(
        self, worker: WorkerSide
    ) -> None:
        request = await worker.new_assignment(TOO_LONG_RUN)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await worker.stub.AssignRun(request)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        status = await worker.status()
        assert request.run_id not in status.running_run_ids
        assert status.num_free_blocks == NUM_BLOCKS

    async def test_cancel_finds_an_assigned_run_once_and_no_unknown_one(
        self, worker: WorkerSide
    ) -> None:
        request = await worker.new_assignment(LONG_RUN)
        await worker.stub.AssignRun(request)
        assert await worker.cancel(request.run_id)

        async def gone() -> bool:
            return request.run_id not in (await worker.status()).running_run_ids

        assert await eventually(gone)
        assert not await worker.cancel(request.run_id)
        assert not await worker.cancel("no-such-run")


class TestFakeWorker(WorkerContractTests):
    @pytest.fixture
    async def worker(self) -> AsyncIterator[WorkerSide]:
        fake = FakeWorker(WORKER_ID, free_blocks=NUM_BLOCKS)
        address = await fake.start()
        runs = iter(range(1_000_000))

        async def new_assignment(max_tokens: int) -> worker_pb2.AssignRunRequest:
            return assignment(f"run-{next(runs)}", max_tokens)

        async with grpc.aio.insecure_channel(address) as channel:
            yield WorkerSide(worker_pb2_grpc.WorkerServiceStub(channel), new_assignment)
        await fake.stop()


class TestWorkerServicer(WorkerContractTests):
    @pytest.fixture
    async def worker(self, database_url: str, tiny_model_dir: Path) -> AsyncIterator[WorkerSide]:
        db = open_db(database_url)
        store = EventStore(db)

        async def new_assignment(max_tokens: int) -> worker_pb2.AssignRunRequest:
            return await leased_run(store, WORKER_ID, max_tokens)

        try:
            async with running_worker(
                store, tiny_model_dir, worker_id=WORKER_ID, num_kv_blocks=NUM_BLOCKS
            ) as real:
                yield WorkerSide(real.stub, new_assignment)
        finally:
            await db.dispose()
