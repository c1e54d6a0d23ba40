"""gRPC servicers of the admission process, GatewayService and AdminService, and the
translation between their protobuf messages and admission's dataclasses."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator

import grpc
from google.protobuf import json_format

from services.admission.catalog import ModelEntry
from services.admission.gateway import Gateway
from services.admission.key_messages import key_to_proto, overlap_from_proto, scopes_from_proto
from services.admission.keys import KeyRepository
from services.admission.quota_proto import (
    key_quota_to_proto,
    limits_from_proto,
    quota_violations,
    rate_fields,
)
from services.admission.requests import PRIORITIES, GenerateParams, Limits, Sampling
from services.admission.run_store import get_tenant_run, list_runs
from services.admission.tenants import (
    DEFAULT_MAX_CONCURRENT_RUNS,
    TenantRecord,
    TenantRepository,
)
from services.core.auth import Principal, bearer_token, is_admin_token, require_model
from services.core.codec import PROTO_STATES, to_proto
from services.core.db import Database
from services.core.errors import FieldViolation, InvalidArgument, Unauthenticated
from services.core.grpc_errors import rpc_errors
from services.core.runs import RunView
from services.core.telemetry import bound_log_context
from services.core.validation import duration_seconds, seq_violation, text_violation
from tollgate.v1 import admin_pb2, admin_pb2_grpc, events_pb2, gateway_pb2, gateway_pb2_grpc

# Names are unique through an index, whose rows PostgreSQL keeps to under 2,700 bytes.
MAX_TENANT_NAME = 200


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def _principal(self, context: grpc.aio.ServicerContext) -> Principal:
        return await self.gateway.principal(context.invocation_metadata() or (), context.peer())

    async def _tenant(self, context: grpc.aio.ServicerContext) -> str:
        tenant_id = (await self._principal(context)).tenant_id
        assert tenant_id is not None
        return tenant_id

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
                tenant_id, started.run_id, 0, params.until_terminal, known=started.stored
            )
            async for event in events:
                yield to_proto(event)

    @rpc_errors
    async def StreamRun(
        self, request: gateway_pb2.StreamRunRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[events_pb2.RunEvent]:
        tenant_id = await self._tenant(context)
        too_far = seq_violation("starting_after", request.starting_after)
        if too_far is not None:
            raise InvalidArgument([too_far])
        run = await get_tenant_run(self.gateway.store, tenant_id, request.run_id)
        with bound_log_context(run_id=run.run_id, tenant_id=tenant_id):
            events = await self.gateway.follow(
                tenant_id, run.run_id, request.starting_after, request.until_terminal
            )
            async for event in events:
                yield to_proto(event)

    @rpc_errors
    async def CancelRun(
        self, request: gateway_pb2.CancelRunRequest, context: grpc.aio.ServicerContext
    ) -> events_pb2.Run:
        tenant_id = await self._tenant(context)
        run = await get_tenant_run(self.gateway.store, tenant_id, request.run_id)
        return run_to_proto(await self.gateway.canceller.cancel(run, "cancelled by client"))

    @rpc_errors
    async def GetRun(
        self, request: gateway_pb2.GetRunRequest, context: grpc.aio.ServicerContext
    ) -> events_pb2.Run:
        tenant_id = await self._tenant(context)
        return run_to_proto(await get_tenant_run(self.gateway.store, tenant_id, request.run_id))

    @rpc_errors
    async def ListRuns(
        self, request: gateway_pb2.ListRunsRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ListRunsResponse:
        tenant_id = await self._tenant(context)
        page, token = await list_runs(
            self.gateway.db, tenant_id, request.page_size, request.page_token
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


class AdminServicer(admin_pb2_grpc.AdminServiceServicer):
    def __init__(
        self,
        db: Database,
        admin_token: str,
        default_max_concurrent_runs: int = DEFAULT_MAX_CONCURRENT_RUNS,
    ) -> None:
        self.tenants = TenantRepository(db, default_max_concurrent_runs)
        self.keys = KeyRepository(db)
        self.admin_token = admin_token

    def _require_admin(self, context: grpc.aio.ServicerContext) -> None:
        token = bearer_token(context.invocation_metadata())
        if not self.admin_token:
            raise Unauthenticated("the admin API is disabled: TOLLGATE_ADMIN_TOKEN is not set")
        if token is None or not is_admin_token(token, self.admin_token):
            raise Unauthenticated("missing or wrong admin token")

    @rpc_errors
    async def CreateTenant(
        self, request: admin_pb2.CreateTenantRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.Tenant:
        self._require_admin(context)
        violations = []
        name = request.name.strip()
        if not name:
            violations.append(FieldViolation("name", "must not be empty"))
        elif (bad_name := text_violation("name", name, MAX_TENANT_NAME)) is not None:
            violations.append(bad_name)
        if request.weight < 0:
            violations.append(FieldViolation("weight", "must be positive (0 means the default, 1)"))
        if violations:
            raise InvalidArgument(violations)
        return tenant_to_proto(await self.tenants.create(name, request.weight or 1))

    @rpc_errors
    async def GetTenant(
        self, request: admin_pb2.GetTenantRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.Tenant:
        self._require_admin(context)
        return tenant_to_proto(await self.tenants.get(request.tenant_id))

    @rpc_errors
    async def ListTenants(
        self, request: admin_pb2.ListTenantsRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ListTenantsResponse:
        self._require_admin(context)
        return admin_pb2.ListTenantsResponse(
            tenants=[tenant_to_proto(t) for t in await self.tenants.list()]
        )

    @rpc_errors
    async def CreateApiKey(
        self, request: admin_pb2.CreateApiKeyRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ApiKey:
        self._require_admin(context)
        scopes = scopes_from_proto(request)
        return key_to_proto(await self.keys.create(request.tenant_id, scopes))

    @rpc_errors
    async def RevokeApiKey(
        self, request: admin_pb2.RevokeApiKeyRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ApiKey:
        self._require_admin(context)
        return key_to_proto(await self.keys.revoke(request.key_id))

    @rpc_errors
    async def ListApiKeys(
        self, request: admin_pb2.ListApiKeysRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ListApiKeysResponse:
        self._require_admin(context)
        keys, token = await self.keys.list(request.tenant_id, request.page_size, request.page_token)
        return admin_pb2.ListApiKeysResponse(
            api_keys=[key_to_proto(k) for k in keys], next_page_token=token
        )

    @rpc_errors
    async def RotateApiKey(
        self, request: admin_pb2.RotateApiKeyRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ApiKey:
        self._require_admin(context)
        overlap = overlap_from_proto(request)
        return key_to_proto(await self.keys.rotate(request.key_id, overlap))

    @rpc_errors
    async def SetQuota(
        self, request: admin_pb2.SetQuotaRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.Quota:
        self._require_admin(context)
        quota = request.quota
        violations = quota_violations(quota)
        if violations:
            raise InvalidArgument(violations)
        limits = limits_from_proto(quota)
        if quota.key_id:
            key_quota = await self.tenants.set_key_quota(quota.tenant_id, quota.key_id, limits)
            return key_quota_to_proto(key_quota)
        streams = quota.max_concurrent_streams if quota.HasField("max_concurrent_streams") else None
        tenant = await self.tenants.set_quota(
            quota.tenant_id, quota.max_kv_blocks, quota.max_concurrent_runs, streams, limits
        )
        return tenant_to_proto(tenant).quota


def params_from_proto(request: events_pb2.GenerateRequest, limits: Limits) -> GenerateParams:
    s = request.sampling
    sampling = Sampling(
        max_tokens=s.max_tokens,
        temperature=s.temperature if s.HasField("temperature") else None,
        top_k=s.top_k if s.HasField("top_k") else None,
        top_p=s.top_p if s.HasField("top_p") else None,
        seed=s.seed if s.HasField("seed") else None,
        stop=tuple(s.stop),
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
    )
    priority = PRIORITIES.get(
        request.priority or events_pb2.PRIORITY_INTERACTIVE, f"unknown ({request.priority})"
    )
    return GenerateParams(
        model=request.model,
        prompt=request.prompt,
        messages=tuple((m.role, m.content) for m in request.messages),
        sampling=sampling,
        priority=priority,
        idempotency_key=request.idempotency_key,
        disconnect_grace=_grace(request, limits.default_disconnect_grace),
        until_terminal=request.until_terminal,
    )


def _grace(request: events_pb2.GenerateRequest, default: float) -> float:
    """NaN, which validation refuses, for a malformed duration; not ToTimedelta, which
    overflows on a huge one."""
    if not request.HasField("disconnect_grace"):
        return default
    grace = request.disconnect_grace
    seconds = duration_seconds(grace.seconds, grace.nanos)
    return math.nan if seconds is None else seconds


def run_to_proto(run: RunView) -> events_pb2.Run:
    message = events_pb2.Run(
        run_id=run.run_id,
        tenant_id=run.tenant_id,
        model=run.model,
        state=PROTO_STATES[run.state] if run.state else events_pb2.RUN_STATE_UNSPECIFIED,  # type: ignore[arg-type]
        last_seq=run.last_seq,
        idempotency_key=run.idempotency_key or "",
        finish_reason=run.finish_reason or "",
        priority=events_pb2.PRIORITY_BATCH
        if run.priority == "batch"
        else events_pb2.PRIORITY_INTERACTIVE,
    )
    json_format.ParseDict(dict(run.usage), message.usage, ignore_unknown_fields=True)
    if run.created_at:
        message.create_time.FromDatetime(run.created_at)
    if run.updated_at:
        message.update_time.FromDatetime(run.updated_at)
    return message


def model_to_proto(entry: ModelEntry) -> gateway_pb2.Model:
    return gateway_pb2.Model(
        name=entry.name, base=entry.parent, context_length=entry.context_length
    )


def tenant_to_proto(tenant: TenantRecord) -> admin_pb2.Tenant:
    quota = admin_pb2.Quota(
        tenant_id=tenant.tenant_id,
        max_kv_blocks=tenant.max_kv_blocks,
        max_concurrent_runs=tenant.max_concurrent_runs,
        max_concurrent_streams=tenant.max_concurrent_streams,
        **rate_fields(tenant.limits),
    )
    return admin_pb2.Tenant(
        tenant_id=tenant.tenant_id,
        name=tenant.name,
        weight=tenant.weight,
        quota=quota,
        key_quotas=[key_quota_to_proto(k) for k in tenant.key_quotas],
    )
