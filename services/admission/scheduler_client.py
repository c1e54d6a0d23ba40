"""gRPC calls to the scheduler's `SchedulerService`; protobuf stays in this module.

Admission hints each new run as soon as it is queued, asks the scheduler to cancel runs
and reads its queues and workers (a `FleetView`) for back-pressure and the console. None of it is needed for a run to be served:
a lost hint costs latency, never a run, because the `queued` event on Kafka and the
scheduler's rescan of the projection still bring every run in.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import fields

import grpc
import structlog

from services.admission.admit import Admitted
from services.core.codec import tenant_loads_of
from services.core.fleet import FleetView, WorkerLoad
from services.core.internal import internal_channel
from tollgate.v1 import scheduler_pb2, scheduler_pb2_grpc

log = structlog.get_logger(__name__)

HINT_TIMEOUT_S = 2.0
CANCEL_TIMEOUT_S = 3.0
QUEUE_STATS_TIMEOUT_S = 2.0
QUEUE_STATS_INTERVAL_S = 1.0


class SchedulerClient:
    def __init__(self, address: str, internal_token: str = "") -> None:
        self.channel = internal_channel(address, internal_token)
        self.stub = scheduler_pb2_grpc.SchedulerServiceStub(self.channel)
        self._in_flight: set[asyncio.Task[None]] = set()
        # The latest answer, kept current by `watch_fleet`.
        self.view = FleetView()

    def hint(self, admitted: Admitted) -> None:
        """Sends the run as admission stored it, without making the client wait: the
        scheduler queues it without the trip through the relay and Kafka, and without
        reading it back."""
        task = asyncio.create_task(self._send_hint(hinted_run(admitted)))
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)

    async def _send_hint(self, run: scheduler_pb2.HintedRun) -> None:
        request = scheduler_pb2.RunsQueuedRequest(runs=[run])
        try:
            await self.stub.RunsQueued(request, timeout=HINT_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            log.debug("scheduler hint lost", run_id=run.run_id, code=error.code().name)

    async def cancel(self, run_id: str, reason: str) -> bool:
        """Whether the scheduler knew the run and will see it ended (queued: at once;
        assigned: by its worker)."""
        request = scheduler_pb2.SchedulerCancelRunRequest(run_id=run_id, reason=reason)
        try:
            reply = await self.stub.CancelRun(request, timeout=CANCEL_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            log.warning("scheduler cancel failed", run_id=run_id, code=error.code().name)
            return False
        return bool(reply.found)

    async def fleet(self) -> FleetView | None:
        """The queues and workers now; None when the scheduler does not answer."""
        request = scheduler_pb2.GetQueueStatsRequest()
        try:
            stats = await self.stub.GetQueueStats(request, timeout=QUEUE_STATS_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            return None
        return fleet_view(stats)

    async def watch_fleet(self) -> None:
        """Keeps `view` current until cancelled. A scheduler that does not answer reads as
        the empty view: nothing is refused for it."""
        while True:
            self.view = await self.fleet() or FleetView()
            await asyncio.sleep(QUEUE_STATS_INTERVAL_S)

    async def close(self) -> None:
        await self.channel.close()


def fleet_view(stats: scheduler_pb2.QueueStats) -> FleetView:
    return FleetView(
        num_interactive=stats.num_interactive,
        num_batch=stats.num_batch,
        num_running=stats.num_running,
        num_workers=stats.num_workers,
        num_free_blocks=stats.num_free_blocks,
        num_total_blocks=stats.num_total_blocks,
        num_queued_interactive_blocks=stats.num_queued_interactive_blocks,
        num_queued_batch_blocks=stats.num_queued_batch_blocks,
        max_run_tokens=dict(stats.max_run_tokens),
        workers=tuple(worker_load(w) for w in stats.workers),
    )


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


def worker_load(message: scheduler_pb2.WorkerLoad) -> WorkerLoad:
    values = {f.name: getattr(message, f.name) for f in fields(WorkerLoad)}
    return WorkerLoad(**{**values, "tenants": tenant_loads_of(message.tenants)})
