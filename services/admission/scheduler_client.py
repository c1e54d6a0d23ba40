"""gRPC calls to the scheduler's `SchedulerService`; protobuf stays in this module.

Admission hints each new run as soon as it is queued, asks the scheduler to cancel runs
and reads its queue depth for back-pressure. None of it is needed for a run to be served:
a lost hint costs latency, never a run, because the `queued` event on Kafka and the
scheduler's rescan of the projection still bring every run in.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, fields

import grpc
import structlog

from services.admission.admit import Admitted
from services.admission.backpressure import FleetLoad
from services.core.errors import FieldViolation, InvalidArgument
from services.core.fleet import WorkerLoad
from services.core.internal import internal_channel
from tollgate.v1 import scheduler_pb2, scheduler_pb2_grpc

log = structlog.get_logger(__name__)

HINT_TIMEOUT_S = 2.0
CANCEL_TIMEOUT_S = 3.0
QUEUE_STATS_TIMEOUT_S = 2.0
QUEUE_STATS_INTERVAL_S = 1.0


class QueueDepth:
    """The scheduler's queue depth and the fleet's load, refreshed in the background for
    back-pressure, and the fleet's largest pool per model, for runs that could never fit."""

    def __init__(self) -> None:
        self.value = 0
        self.load = FleetLoad()
        # model -> the most tokens (prompt + max_tokens) one run may hold on any live
        # worker serving it; a model absent is not known to be served yet.
        self.max_run_tokens: dict[str, int] = {}

    def fit_violation(
        self, model: str, num_prompt_tokens: int, max_tokens: int
    ) -> InvalidArgument | None:
        """The refusal of a run larger than every live pool serving `model`."""
        largest = self.max_run_tokens.get(model)
        if largest is None or num_prompt_tokens + max_tokens <= largest:
            return None
        message = (
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the "
            f"{largest} tokens the largest worker serving {model} can hold"
        )
        return InvalidArgument([FieldViolation("sampling.max_tokens", message)])


@dataclass(frozen=True, slots=True)
class Fleet:
    """The scheduler's queues and workers, as the operator console shows them."""

    num_interactive: int
    num_batch: int
    num_running: int
    num_workers: int
    num_free_blocks: int
    workers: list[WorkerLoad]


class SchedulerClient:
    def __init__(self, address: str, internal_token: str = "") -> None:
        self.channel = internal_channel(address, internal_token)
        self.stub = scheduler_pb2_grpc.SchedulerServiceStub(self.channel)
        self._in_flight: set[asyncio.Task[None]] = set()

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

    async def queue_depth(self) -> int:
        """Runs queued at the scheduler; 0 when it does not answer (admit: the scheduler's
        own queue bounds the rest)."""
        stats = await self._queue_stats()
        return int(stats.num_interactive + stats.num_batch) if stats else 0

    async def fleet(self) -> Fleet | None:
        """The queues and workers; None when the scheduler does not answer."""
        stats = await self._queue_stats()
        if stats is None:
            return None
        return Fleet(
            num_interactive=stats.num_interactive,
            num_batch=stats.num_batch,
            num_running=stats.num_running,
            num_workers=stats.num_workers,
            num_free_blocks=stats.num_free_blocks,
            workers=[worker_load(w) for w in stats.workers],
        )

    async def _queue_stats(self) -> scheduler_pb2.QueueStats | None:
        request = scheduler_pb2.GetQueueStatsRequest()
        try:
            return await self.stub.GetQueueStats(request, timeout=QUEUE_STATS_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            return None

    async def watch_queue_depth(self, depth: QueueDepth) -> None:
        """Keeps `depth` current until cancelled. A scheduler that does not answer reads
        as an empty queue and a fleet of unknown size: nothing is refused for it."""
        while True:
            stats = await self._queue_stats()
            depth.value = int(stats.num_interactive + stats.num_batch) if stats else 0
            depth.load = fleet_load(stats) if stats else FleetLoad()
            depth.max_run_tokens = dict(stats.max_run_tokens) if stats else {}
            await asyncio.sleep(QUEUE_STATS_INTERVAL_S)

    async def close(self) -> None:
        await self.channel.close()


def fleet_load(stats: scheduler_pb2.QueueStats) -> FleetLoad:
    return FleetLoad(
        num_interactive=stats.num_interactive,
        num_batch=stats.num_batch,
        num_free_blocks=stats.num_free_blocks,
        num_total_blocks=stats.num_total_blocks,
        num_queued_interactive_blocks=stats.num_queued_interactive_blocks,
        num_queued_batch_blocks=stats.num_queued_batch_blocks,
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
    return WorkerLoad(*(getattr(message, f.name) for f in fields(WorkerLoad)))
