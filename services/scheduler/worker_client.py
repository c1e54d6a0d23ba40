"""gRPC calls to workers' WorkerService; protobuf stays in this module."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

import grpc
import structlog
from google.protobuf import json_format

from services.core.codec import tenant_loads_of
from services.core.internal import internal_channel
from services.core.telemetry import current_traceparent
from services.scheduler.fair_queue import QueueClass
from services.scheduler.records import QueuedRun
from services.scheduler.workers import WorkerReport
from tollgate.v1 import events_pb2, worker_pb2, worker_pb2_grpc

log = structlog.get_logger(__name__)

PRIORITIES: Mapping[QueueClass, int] = {
    QueueClass.INTERACTIVE: events_pb2.PRIORITY_INTERACTIVE,
    QueueClass.BATCH: events_pb2.PRIORITY_BATCH,
}


class AssignOutcome(StrEnum):
    ASSIGNED = "assigned"
    NO_ROOM = "no_room"  # RESOURCE_EXHAUSTED
    UNREACHABLE = "unreachable"  # UNAVAILABLE, deadline: the worker may be down
    REFUSED = "refused"  # any other error


@dataclass(frozen=True, slots=True)
class AssignResult:
    outcome: AssignOutcome
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Grant:
    """The lease a run is assigned under."""

    lease_epoch: int
    last_seq: int


_OUTCOMES = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: AssignOutcome.NO_ROOM,
    grpc.StatusCode.UNAVAILABLE: AssignOutcome.UNREACHABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: AssignOutcome.UNREACHABLE,
}


def assign_request(run: QueuedRun, grant: Grant) -> worker_pb2.AssignRunRequest:
    request = worker_pb2.AssignRunRequest(
        run_id=run.run_id,
        tenant_id=run.tenant_id,
        model=run.model,
        prompt_token_ids=run.prompt_token_ids,
        priority=PRIORITIES[run.queue_class],  # type: ignore[arg-type]
        lease_epoch=grant.lease_epoch,
        # The dispatch span's, when there is one: the worker's span is its child.
        traceparent=current_traceparent() or run.traceparent,
        last_seq=grant.last_seq,
        cache_namespace=run.tenant_id,
        tenant_weight=max(1, run.weight),
    )
    json_format.ParseDict(dict(run.sampling), request.sampling, ignore_unknown_fields=True)
    return request


def report_of(status: worker_pb2.WorkerStatus) -> WorkerReport:
    return WorkerReport(
        num_free_blocks=status.num_free_blocks,
        running_run_ids=frozenset(status.running_run_ids),
        model=status.model,
        adapters=frozenset(status.adapters),
        num_total_blocks=status.num_total_blocks,
        block_size=status.block_size,
        draining=status.draining,
        boot_id=status.boot_id,
        engine_kind=status.engine_kind,
        max_run_tokens=status.max_run_tokens,
        tenants=tenant_loads_of(status.tenants),
        suspends_runs=status.suspends_runs,
    )


class WorkerClients:
    """One channel per worker address, reused across calls."""

    def __init__(
        self, rpc_timeout: float = 3.0, cancel_timeout: float = 1.5, internal_token: str = ""
    ) -> None:
        self.rpc_timeout = rpc_timeout
        self.internal_token = internal_token
        # Admission gives the scheduler's CancelRun 3 s in all.
        self.cancel_timeout = cancel_timeout
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _stub(self, address: str) -> worker_pb2_grpc.WorkerServiceStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = internal_channel(address, self.internal_token)
        return worker_pb2_grpc.WorkerServiceStub(channel)

    async def assign(self, address: str, run: QueuedRun, grant: Grant) -> AssignResult:
        try:
            await self._stub(address).AssignRun(
                assign_request(run, grant), timeout=self.rpc_timeout
            )
        except grpc.aio.AioRpcError as error:
            outcome = _OUTCOMES.get(error.code(), AssignOutcome.REFUSED)
            detail = f"{error.code().name}: {error.details()}"
            log.info("assign failed", run_id=run.run_id, address=address, detail=detail)
            return AssignResult(outcome, detail)
        return AssignResult(AssignOutcome.ASSIGNED)

    async def cancel(self, address: str, run_id: str, reason: str) -> bool | None:
        """The worker's `found`, or None when it could not be asked."""
        request = worker_pb2.CancelAssignedRunRequest(run_id=run_id, reason=reason)
        try:
            reply = await self._stub(address).CancelAssignedRun(
                request, timeout=self.cancel_timeout
            )
        except grpc.aio.AioRpcError as error:
            log.warning("cancel at worker failed", run_id=run_id, code=error.code().name)
            return None
        return bool(reply.found)

    async def status(self, address: str, timeout: float) -> WorkerReport | None:
        try:
            status = await self._stub(address).GetWorkerStatus(
                worker_pb2.GetWorkerStatusRequest(), timeout=timeout
            )
        except grpc.aio.AioRpcError:
            return None
        return report_of(status)

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            with contextlib.suppress(Exception):
                await channel.close()
