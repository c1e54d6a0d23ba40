"""The public `GatewayService`: authenticates each call, then translates between its
protobuf messages and admission's `Gateway` (messages.py holds the translation)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from services.admission.gateway import Gateway
from services.admission.grpc.messages import model_to_proto, params_from_proto, run_to_proto
from services.admission.run_store import get_visible_run, list_runs
from services.core.auth import Principal, require_model
from services.core.codec import to_proto
from services.core.errors import InvalidArgument
from services.core.grpc_errors import rpc_errors
from services.core.live import Position
from services.core.telemetry import bound_log_context
from services.core.validation import seq_violation
from tollgate.v1 import events_pb2, gateway_pb2, gateway_pb2_grpc


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def _principal(self, context: grpc.aio.ServicerContext) -> Principal:
        return await self.gateway.principal(context.invocation_metadata() or (), context.peer())

    @rpc_errors
    async def Generate(
        self, request: events_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[events_pb2.RunEvent]:
        principal = await self._principal(context)
        tenant_id = principal.tenant_id
        assert tenant_id is not None
        params = params_from_proto(request, self.gateway.config.limits)
        require_model(principal, params.model)
        started = await self.gateway.start(tenant_id, params, principal.key_id or "")
        if started.rate_limits:
            await context.send_initial_metadata(tuple(started.rate_limits.items()))
        with bound_log_context(run_id=started.run_id, tenant_id=tenant_id):
            events = await self.gateway.follow(
                principal,
                started.run_id,
                Position(0),
                params.until_terminal,
                known=started.stored,
                live=request.live,
            )
            async for event in events:
                yield to_proto(event)

    @rpc_errors
    async def StreamRun(
        self, request: gateway_pb2.StreamRunRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[events_pb2.RunEvent]:
        principal = await self._principal(context)
        too_far = seq_violation("starting_after", request.starting_after)
        if too_far is not None:
            raise InvalidArgument([too_far])
        run = await get_visible_run(self.gateway.store, principal, request.run_id)
        after = Position(request.starting_after, request.after_tokens, request.after_chars)
        with bound_log_context(run_id=run.run_id, tenant_id=run.tenant_id):
            events = await self.gateway.follow(
                principal, run.run_id, after, request.until_terminal, live=request.live
            )
            async for event in events:
                yield to_proto(event)

    @rpc_errors
    async def CancelRun(
        self, request: gateway_pb2.CancelRunRequest, context: grpc.aio.ServicerContext
    ) -> events_pb2.Run:
        principal = await self._principal(context)
        run = await get_visible_run(self.gateway.store, principal, request.run_id)
        return run_to_proto(await self.gateway.canceller.cancel(run, "cancelled by client"))

    @rpc_errors
    async def GetRun(
        self, request: gateway_pb2.GetRunRequest, context: grpc.aio.ServicerContext
    ) -> events_pb2.Run:
        principal = await self._principal(context)
        return run_to_proto(await get_visible_run(self.gateway.store, principal, request.run_id))

    @rpc_errors
    async def ListRuns(
        self, request: gateway_pb2.ListRunsRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ListRunsResponse:
        principal = await self._principal(context)
        page, token = await list_runs(
            self.gateway.db, principal, request.page_size, request.page_token
        )
        return gateway_pb2.ListRunsResponse(
            runs=[run_to_proto(r) for r in page], next_page_token=token
        )

    @rpc_errors
    async def ListModels(
        self, request: gateway_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ListModelsResponse:
        models = self.gateway.catalog.usable_by(await self._principal(context))
        return gateway_pb2.ListModelsResponse(models=[model_to_proto(m) for m in models])
