"""The scheduler trusts a registering worker's address, and takes cancels, only from
callers with the internal token: a stranger cannot have other tenants' prompts sent to
an address of its choosing, nor cancel their runs."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from services.core.internal import internal_channel, server_interceptors
from services.core.server import create_server
from services.scheduler.cancel import Canceller
from services.scheduler.servicer import SchedulerServicer
from services.scheduler.state import SchedulerState
from services.scheduler.workers import WorkerRegistry
from tollgate.v1 import scheduler_pb2, scheduler_pb2_grpc

TOKEN = "scheduler-internal-token"
SERVICE = scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"].full_name


class NoCancels(Canceller):
    def __init__(self) -> None:
        self.cancelled: list[str] = []

    async def cancel(self, run_id: str, reason: str) -> bool:
        self.cancelled.append(run_id)
        return True


@pytest.fixture
async def scheduler() -> AsyncIterator[tuple[str, SchedulerState, NoCancels]]:
    state, canceller = SchedulerState(WorkerRegistry()), NoCancels()
    servicer = SchedulerServicer(state, canceller, heartbeat_interval=1.0)
    server, port, _ = create_server(
        "127.0.0.1:0",
        lambda s: scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(servicer, s),
        interceptors=server_interceptors(TOKEN, [SERVICE]),
    )
    await server.start()
    try:
        yield f"127.0.0.1:{port}", state, canceller
    finally:
        await server.stop(0)


REGISTER = scheduler_pb2.RegisterWorkerRequest(
    worker_id="w-1", address="10.0.0.66:50061", model="tiny", boot_id="b"
)


async def test_a_worker_registers_only_with_the_internal_token(
    scheduler: tuple[str, SchedulerState, NoCancels],
) -> None:
    address, state, canceller = scheduler
    for token in ("", "wrong-token"):
        async with internal_channel(address, token) as channel:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
            for call in (
                stub.RegisterWorker(REGISTER, timeout=10),
                stub.CancelRun(scheduler_pb2.SchedulerCancelRunRequest(run_id="r"), timeout=10),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert state.registry.all() == [] and canceller.cancelled == []
    async with internal_channel(address, TOKEN) as channel:
        await scheduler_pb2_grpc.SchedulerServiceStub(channel).RegisterWorker(REGISTER, timeout=10)
    [worker] = state.registry.all()
    assert (worker.worker_id, worker.address) == ("w-1", "10.0.0.66:50061")
