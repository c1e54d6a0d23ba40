"""Tells the scheduler about runs as soon as they are queued, without making clients wait.

A hint only saves the scheduler the trip through the outbox relay and Kafka: a lost one
costs latency, never a run, because the `queued` event and the scheduler's rescan still
bring every run in.
"""

from __future__ import annotations

import asyncio

import grpc
import structlog

from tollgate.v1 import scheduler_pb2, scheduler_pb2_grpc

log = structlog.get_logger(__name__)

HINT_TIMEOUT_S = 2.0


class QueuedHints:
    def __init__(self, stub: scheduler_pb2_grpc.SchedulerServiceStub) -> None:
        self.stub = stub
        self._in_flight: set[asyncio.Task[None]] = set()

    def __call__(self, run_id: str) -> None:
        task = asyncio.create_task(self._send(run_id))
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)

    async def _send(self, run_id: str) -> None:
        request = scheduler_pb2.RunsQueuedRequest(run_ids=[run_id])
        try:
            await self.stub.RunsQueued(request, timeout=HINT_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            log.debug("scheduler hint lost", run_id=run_id, code=error.code().name)
