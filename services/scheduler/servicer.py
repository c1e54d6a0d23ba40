"""SchedulerService: protobuf in, scheduler core, protobuf out."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import fields
from datetime import UTC

import grpc

from services.core.codec import tenant_loads_of, tenant_shares
from services.core.errors import FailedPrecondition, FieldViolation, InvalidArgument
from services.core.fleet import WorkerLoad
from services.core.grpc_errors import rpc_errors
from services.scheduler.cancel import Canceller
from services.scheduler.records import QueuedRun, queued_run
from services.scheduler.state import SchedulerState
from services.scheduler.workers import WorkerIdTaken, WorkerReport
from tollgate.v1 import scheduler_pb2, scheduler_pb2_grpc


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(
        self,
        state: SchedulerState,
        canceller: Canceller,
        *,
        heartbeat_interval: float,
        on_register: Callable[[], None] = lambda: None,
        on_queued: Callable[[Collection[str]], Awaitable[int]] | None = None,
        on_hinted: Callable[[Collection[QueuedRun]], int] | None = None,
        block_size: int = 16,
    ) -> None:
        self.state = state
        self.canceller = canceller
        self.heartbeat_interval = heartbeat_interval
        self.on_register = on_register
        self.on_queued = on_queued
        self.on_hinted = on_hinted
        self.block_size = block_size

    @rpc_errors
    async def GetQueueStats(
        self, request: scheduler_pb2.GetQueueStatsRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.QueueStats:
        stats = self.state.stats()
        return scheduler_pb2.QueueStats(
            num_interactive=stats.num_interactive,
            num_batch=stats.num_batch,
            num_running=stats.num_running,
            num_workers=stats.num_workers,
            num_free_blocks=stats.num_free_blocks,
            max_run_tokens=stats.max_run_tokens,
            num_total_blocks=stats.num_total_blocks,
            num_queued_interactive_blocks=stats.num_queued_interactive_blocks,
            num_queued_batch_blocks=stats.num_queued_batch_blocks,
            workers=[worker_load_proto(w) for w in stats.workers],
        )

    @rpc_errors
    async def RegisterWorker(
        self, request: scheduler_pb2.RegisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.RegisterWorkerResponse:
        _require(worker_id=request.worker_id, address=request.address)
        try:
            self.state.registry.register(
                request.worker_id,
                request.address,
                request.model,
                time.monotonic(),
                request.boot_id,
                request.adapters,
                request.engine_kind,
            )
        except WorkerIdTaken as taken:
            raise FailedPrecondition(
                f"{taken}; give each worker its own TOLLGATE_WORKER_ID",
                "WORKER_ID_TAKEN",
                {"worker_id": taken.worker_id, "address": taken.address},
            ) from None
        self.on_register()
        return scheduler_pb2.RegisterWorkerResponse(
            heartbeat_interval_seconds=self.heartbeat_interval
        )

    @rpc_errors
    async def Heartbeat(
        self, request: scheduler_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.HeartbeatResponse:
        _require(worker_id=request.worker_id)
        report = WorkerReport(
            num_free_blocks=request.num_free_blocks,
            running_run_ids=frozenset(request.running_run_ids),
            draining=request.draining,
            boot_id=request.boot_id,
            tenants=tenant_loads_of(request.tenants),
            suspends_runs=request.suspends_runs,
        )
        known = self.state.registry.heartbeat(request.worker_id, report, time.monotonic())
        if known:
            self.state.wake.set()
        return scheduler_pb2.HeartbeatResponse(known=known)

    @rpc_errors
    async def CancelRun(
        self, request: scheduler_pb2.SchedulerCancelRunRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SchedulerCancelRunResponse:
        _require(run_id=request.run_id)
        found = await self.canceller.cancel(request.run_id, request.reason)
        return scheduler_pb2.SchedulerCancelRunResponse(found=found)

    @rpc_errors
    async def RunsQueued(
        self, request: scheduler_pb2.RunsQueuedRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.RunsQueuedResponse:
        taken = 0
        if self.on_hinted is not None and request.runs:
            taken += self.on_hinted([run_from_hint(h, self.block_size) for h in request.runs])
        if self.on_queued is not None and request.run_ids:
            taken += await self.on_queued(request.run_ids)
        return scheduler_pb2.RunsQueuedResponse(num_taken=taken)


def run_from_hint(hint: scheduler_pb2.HintedRun, block_size: int) -> QueuedRun:
    """The run admission describes, as `SchedulerStore.load_queued` would read it.

    Its creation time is its `queued` event's: the same transaction, a statement later
    than the projection row's, which only orders it among runs created that instant.
    """
    queued_at = hint.queued_at.ToDatetime(UTC).timestamp()
    return queued_run(
        run_id=hint.run_id,
        tenant_id=hint.tenant_id,
        model=hint.model,
        priority=hint.priority,
        last_seq=hint.last_seq,
        payload=json.loads(hint.queued_payload_json),
        traceparent=hint.traceparent,
        created_at=queued_at,
        queued_at=queued_at,
        weight=hint.tenant_weight,
        block_size=block_size,
    )


def _require(**fields: str) -> None:
    missing = [FieldViolation(name, "is required") for name, value in fields.items() if not value]
    if missing:
        raise InvalidArgument(missing)


def worker_load_proto(load: WorkerLoad) -> scheduler_pb2.WorkerLoad:
    values = {f.name: getattr(load, f.name) for f in fields(load) if f.name != "tenants"}
    return scheduler_pb2.WorkerLoad(**values, tenants=tenant_shares(load.tenants))
