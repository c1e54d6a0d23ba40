"""The admin `Quota` message: its validation and its translation to QuotaLimits."""

from __future__ import annotations

from typing import Any

from services.admission.tenants import KeyQuota
from services.core.errors import FieldViolation
from services.core.quota_store import RATE_FIELDS
from services.core.quotas import BUDGET_PERIODS, QuotaLimits
from tollgate.v1 import admin_pb2

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
