"""The worker's heartbeat loop against a scheduler that records what it is told."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import pytest

from services.worker.app import heartbeat
from services.worker.core import Status
from tollgate.v1 import scheduler_pb2, scheduler_pb2_grpc

INTERVAL_S = 30.0  # no test waits it out: every beat after the first is one asked for


@dataclass
class RecordingScheduler(scheduler_pb2_grpc.SchedulerServiceServicer):
    beats: list[tuple[float, int]] = field(default_factory=list)
    beat: asyncio.Event = field(default_factory=asyncio.Event)

    async def RegisterWorker(  # noqa: N802 - gRPC's name
        self, request: scheduler_pb2.RegisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.RegisterWorkerResponse:
        return scheduler_pb2.RegisterWorkerResponse(heartbeat_interval_seconds=INTERVAL_S)

    async def Heartbeat(  # noqa: N802 - gRPC's name
        self, request: scheduler_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.HeartbeatResponse:
        self.beats.append((time.monotonic(), request.num_free_blocks))
        self.beat.set()
        return scheduler_pb2.HeartbeatResponse(known=True)


class FakeCore:
    """What the heartbeat reads of a worker: its identity and its room."""

    worker_id, model, boot_id, adapters, engine_kind = "w-1", "tiny", "boot-1", [], "builtin"

    def __init__(self) -> None:
        self.free = 10

    def status(self) -> Status:
        return Status("w-1", "tiny", [], self.free, 10, 4, [], False, "boot-1", "builtin")


@pytest.fixture
async def scheduler() -> AsyncIterator[tuple[RecordingScheduler, str]]:
    servicer = RecordingScheduler()
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


async def next_beat(recorder: RecordingScheduler, timeout: float = 5.0) -> tuple[float, int]:
    recorder.beat.clear()
    await asyncio.wait_for(recorder.beat.wait(), timeout)
    return recorder.beats[-1]


async def test_ended_runs_are_reported_at_once_not_at_the_next_interval(
    scheduler: tuple[RecordingScheduler, str],
) -> None:
    recorder, address = scheduler
    core, runs_ended = FakeCore(), asyncio.Event()
    task = asyncio.create_task(
        heartbeat(core, address, "127.0.0.1:1", runs_ended=runs_ended)  # type: ignore[arg-type]
    )
    try:
        await next_beat(recorder)  # the first, on registering
        core.free = 14  # a run ended and freed its blocks
        asked = time.monotonic()
        runs_ended.set()
        at, free = await next_beat(recorder)
        assert free == 14 and at - asked < 1.0  # well within the 30 s interval
        # Runs ending together share one beat: none follows until another ends.
        with pytest.raises(TimeoutError):
            await next_beat(recorder, timeout=0.3)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
