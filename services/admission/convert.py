"""Translation between gateway protobuf messages and admission's dataclasses."""

from __future__ import annotations

import math

from google.protobuf import json_format

from services.admission.requests import PRIORITIES, GenerateParams, Limits, Sampling
from services.admission.tenants import KeyRecord, TenantRecord
from services.core.codec import PROTO_STATES
from services.core.runs import RunView
from tollgate.v1 import admin_pb2, events_pb2


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
    grace = (
        request.disconnect_grace.ToTimedelta().total_seconds()
        if request.HasField("disconnect_grace")
        else limits.default_disconnect_grace
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
        disconnect_grace=grace if not math.isnan(grace) else -1.0,
        until_terminal=request.until_terminal,
    )


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


def tenant_to_proto(tenant: TenantRecord) -> admin_pb2.Tenant:
    return admin_pb2.Tenant(
        tenant_id=tenant.tenant_id,
        name=tenant.name,
        weight=tenant.weight,
        quota=admin_pb2.Quota(
            tenant_id=tenant.tenant_id,
            max_kv_blocks=tenant.max_kv_blocks,
            max_concurrent_runs=tenant.max_concurrent_runs,
        ),
    )


def key_to_proto(key: KeyRecord) -> admin_pb2.ApiKey:
    return admin_pb2.ApiKey(
        key_id=key.key_id, tenant_id=key.tenant_id, secret=key.secret, revoked=key.revoked
    )
