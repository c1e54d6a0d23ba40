"""WorkerService: protobuf in, WorkerCore out."""

from __future__ import annotations

import grpc

from engine.errors import RequestError
from engine.sampling import Priority, SamplingParams
from services.core.codec import tenant_shares
from services.core.errors import FieldViolation, InvalidArgument
from services.core.grpc_errors import rpc_errors
from services.core.sampling import structure_from_proto
from services.worker.core import Assignment, WorkerCore
from tollgate.v1 import events_pb2, worker_pb2, worker_pb2_grpc


def sampling_from_proto(s: events_pb2.SamplingParams) -> SamplingParams:
    try:
        return _sampling(s)
    except RequestError as error:
        raise InvalidArgument([FieldViolation("sampling", str(error))]) from None


def _sampling(s: events_pb2.SamplingParams) -> SamplingParams:
    json_schema, grammar = structure_from_proto(s).constraint()
    return SamplingParams(
        max_tokens=s.max_tokens,
        temperature=s.temperature if s.HasField("temperature") else 1.0,
        top_k=s.top_k if s.HasField("top_k") else 0,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        seed=s.seed if s.HasField("seed") else None,
        stop=tuple(s.stop),
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        frequency_penalty=s.frequency_penalty,
        presence_penalty=s.presence_penalty,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
        min_p=s.min_p,
        logit_bias=tuple(s.logit_bias.items()),
        json_schema=json_schema,
        grammar=grammar,
        logprobs=s.top_logprobs if s.logprobs else None,
        prompt_logprobs=s.top_logprobs if s.prompt_logprobs else None,
        n=s.n if s.HasField("n") else 1,
    )


def assignment_from_proto(request: worker_pb2.AssignRunRequest) -> Assignment:
    if not request.run_id or not request.prompt_token_ids or request.sampling.max_tokens <= 0:
        raise InvalidArgument(
            [FieldViolation("run_id/prompt_token_ids/sampling", "incomplete assignment")]
        )
    return Assignment(
        run_id=request.run_id,
        tenant_id=request.tenant_id,
        model=request.model,
        prompt_token_ids=list(request.prompt_token_ids),
        sampling=sampling_from_proto(request.sampling),
        priority=Priority.BATCH
        if request.priority == events_pb2.PRIORITY_BATCH
        else Priority.INTERACTIVE,
        lease_epoch=request.lease_epoch,
        last_seq=request.last_seq,
        cache_namespace=request.cache_namespace or request.tenant_id,
        traceparent=request.traceparent,
        tenant_weight=max(1, request.tenant_weight),
    )


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, core: WorkerCore) -> None:
        self.core = core

    @rpc_errors
    async def AssignRun(
        self, request: worker_pb2.AssignRunRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.AssignRunResponse:
        await self.core.assign(assignment_from_proto(request))
        return worker_pb2.AssignRunResponse(worker_id=self.core.worker_id)

    @rpc_errors
    async def CancelAssignedRun(
        self, request: worker_pb2.CancelAssignedRunRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.CancelAssignedRunResponse:
        return worker_pb2.CancelAssignedRunResponse(
            found=self.core.cancel(request.run_id, request.reason)
        )

    @rpc_errors
    async def GetWorkerStatus(
        self, request: worker_pb2.GetWorkerStatusRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerStatus:
        status = self.core.status()
        return worker_pb2.WorkerStatus(
            worker_id=status.worker_id,
            model=status.model,
            adapters=status.adapters,
            engine_kind=status.engine_kind,
            max_run_tokens=status.max_run_tokens,
            num_free_blocks=status.num_free_blocks,
            num_total_blocks=status.num_total_blocks,
            block_size=status.block_size,
            running_run_ids=status.running_run_ids,
            draining=status.draining,
            boot_id=status.boot_id,
            tenants=tenant_shares(status.tenants),
            suspends_runs=status.suspends_runs,
        )
