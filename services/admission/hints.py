"""Tells the scheduler about runs as soon as they are queued, without making clients wait.

A hint carries the run as admission stored it, so the scheduler queues it without the
trip through the outbox relay and Kafka, and without reading it back. A lost one costs
latency, never a run, because the `queued` event and the scheduler's rescan still bring
every run in.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import structlog

from services.admission.admit import Admitted
from tollgate.v1 import scheduler_pb2, scheduler_pb2_grpc

log = structlog.get_logger(__name__)

HINT_TIMEOUT_S = 2.0


class QueuedHints:
    def __init__(self, stub: scheduler_pb2_grpc.SchedulerServiceStub) -> None:
        self.stub = stub
        self._in_flight: set[asyncio.Task[None]] = set()

    def __call__(self, admitted: Admitted) -> None:
        task = asyncio.create_task(self._send(hinted_run(admitted)))
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)

    async def _send(self, run: scheduler_pb2.HintedRun) -> None:
        request = scheduler_pb2.RunsQueuedRequest(runs=[run])
        try:
            await self.stub.RunsQueued(request, timeout=HINT_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            log.debug("scheduler hint lost", run_id=run.run_id, code=error.code().name)


def hinted_run(admitted: Admitted) -> scheduler_pb2.HintedRun:
    queued, params = admitted.queued, admitted.admission.params
    run = scheduler_pb2.HintedRun(
        run_id=queued.run_id,
        tenant_id=queued.tenant_id,
        model=params.model,
        priority=params.priority,
        last_seq=queued.seq,
        queued_payload_json=json.dumps(queued.payload),
        traceparent=queued.traceparent,
        tenant_weight=admitted.tenant_weight,
    )
    run.queued_at.FromDatetime(queued.created_at)
    return run
