"""Admission's protobuf translation: between the GatewayService and AdminService
messages and admission's dataclasses, with the checks that only a message's shape
allows (durations, timestamps, the Quota's fields). Generated types stop here."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any

from google.protobuf import json_format, timestamp_pb2

from engine.structure import ToolCall
from services.admission.catalog import ModelEntry
from services.admission.key_store import (
    DEFAULT_OVERLAP_SECONDS,
    KeyRecord,
    KeyScopes,
    overlap_violation,
    scope_violations,
)
from services.admission.requests import PRIORITIES, ChatTurn, GenerateParams, Limits, Sampling
from services.admission.tenant_store import KeyQuota, TenantRecord
from services.core.codec import PROTO_STATES
from services.core.errors import FieldViolation, InvalidArgument
from services.core.quota_store import RATE_FIELDS
from services.core.quotas import BUDGET_PERIODS, QuotaLimits
from services.core.runs import RunView
from services.core.sampling import structure_from_proto
from services.core.validation import duration_seconds, timestamp_violation
from tollgate.v1 import admin_pb2, events_pb2, gateway_pb2

# GatewayService


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
        frequency_penalty=s.frequency_penalty if s.HasField("frequency_penalty") else None,
        presence_penalty=s.presence_penalty if s.HasField("presence_penalty") else None,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else None,
        min_p=s.min_p if s.HasField("min_p") else None,
        logit_bias=tuple(sorted(s.logit_bias.items())),
        structure=structure_from_proto(s),
        logprobs=s.logprobs,
        top_logprobs=s.top_logprobs,
        n=s.n if s.HasField("n") else 1,
        prompt_logprobs=s.prompt_logprobs,
    )
    priority = PRIORITIES.get(
        request.priority or events_pb2.PRIORITY_INTERACTIVE, f"unknown ({request.priority})"
    )
    return GenerateParams(
        model=request.model,
        prompt=request.prompt,
        messages=tuple(
            ChatTurn(
                m.role,
                m.content,
                tuple(ToolCall(c.id, c.name, c.arguments) for c in m.tool_calls),
                m.tool_call_id,
            )
            for m in request.messages
        ),
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


# AdminService: tenants


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


# AdminService: keys


def scopes_from_proto(request: admin_pb2.CreateApiKeyRequest) -> KeyScopes:
    """The scopes a CreateApiKey asks for; raises InvalidArgument naming each bad field."""
    expire_time = None
    if request.HasField("expire_time"):
        stamp = request.expire_time
        bad_time = timestamp_violation("expire_time", stamp.seconds, stamp.nanos)
        if bad_time is not None:
            raise InvalidArgument([bad_time])
        expire_time = stamp.ToDatetime(tzinfo=UTC)
    scopes = KeyScopes(tuple(request.allowed_models), expire_time, request.alias.strip())
    violations = scope_violations(scopes, datetime.now(UTC))
    if violations:
        raise InvalidArgument(violations)
    return scopes


def overlap_from_proto(request: admin_pb2.RotateApiKeyRequest) -> float:
    """Seconds the replaced secret keeps working; raises InvalidArgument past the bounds."""
    if not request.HasField("overlap"):
        return DEFAULT_OVERLAP_SECONDS
    seconds = duration_seconds(request.overlap.seconds, request.overlap.nanos)
    if seconds is None:
        raise InvalidArgument([FieldViolation("overlap", "is not a valid duration")])
    bad = overlap_violation(seconds)
    if bad is not None:
        raise InvalidArgument([bad])
    return seconds


def key_to_proto(key: KeyRecord) -> admin_pb2.ApiKey:
    message = admin_pb2.ApiKey(
        key_id=key.key_id,
        tenant_id=key.tenant_id,
        secret=key.secret,
        revoked=key.revoked,
        allowed_models=key.scopes.allowed_models,
        alias=key.scopes.alias,
    )
    _set_time(message.expire_time, key.scopes.expire_time)
    _set_time(message.last_used_time, key.last_used_time)
    _set_time(message.create_time, key.create_time)
    _set_time(message.previous_secret_expire_time, key.previous_secret_expire_time)
    return message


def _set_time(field: timestamp_pb2.Timestamp, moment: datetime | None) -> None:
    if moment is not None:
        field.FromDatetime(moment)


# AdminService: quotas

NON_NEGATIVE = (
    "max_kv_blocks",
    "max_concurrent_runs",
    "max_concurrent_streams",
    "requests_per_minute",
    "input_tokens_per_minute",
    "output_tokens_per_minute",
    "budget_micros",
)


def quota_violations(quota: admin_pb2.Quota) -> list[FieldViolation]:
    found = [
        FieldViolation(f"quota.{name}", "must not be negative")
        for name in NON_NEGATIVE
        if getattr(quota, name) < 0
    ]
    if quota.budget_period and quota.budget_period not in BUDGET_PERIODS:
        found.append(
            FieldViolation("quota.budget_period", f"must be one of {', '.join(BUDGET_PERIODS)}")
        )
    if quota.key_id and quota.HasField("max_concurrent_streams"):
        found.append(
            FieldViolation("quota.max_concurrent_streams", "is a tenant's limit, not a key's")
        )
    if not quota.tenant_id and not quota.key_id:
        found.append(FieldViolation("quota.tenant_id", "set a tenant_id (or a key_id)"))
    return found


def limits_from_proto(quota: admin_pb2.Quota) -> QuotaLimits:
    return QuotaLimits(
        requests_per_minute=quota.requests_per_minute,
        input_tokens_per_minute=quota.input_tokens_per_minute,
        output_tokens_per_minute=quota.output_tokens_per_minute,
        budget_micros=quota.budget_micros,
        budget_period=quota.budget_period or "month",
        max_concurrent_runs=quota.max_concurrent_runs,
        max_kv_blocks=quota.max_kv_blocks,
    )


def rate_fields(limits: QuotaLimits) -> dict[str, Any]:
    """The Quota fields of the rate and budget limits; a period only with a budget (a
    quota of none reads back as the empty message it was set with)."""
    fields = {name: getattr(limits, name) for name in RATE_FIELDS}
    if not limits.budget_micros:
        fields["budget_period"] = ""
    return fields


def key_quota_to_proto(key_quota: KeyQuota) -> admin_pb2.Quota:
    limits = key_quota.limits
    return admin_pb2.Quota(
        tenant_id=key_quota.tenant_id,
        key_id=key_quota.key_id,
        max_kv_blocks=limits.max_kv_blocks,
        max_concurrent_runs=limits.max_concurrent_runs,
        **rate_fields(limits),
    )
