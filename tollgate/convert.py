"""Translation between the generated `tollgate.v1` messages and the SDK's dataclasses."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from google.protobuf import duration_pb2, timestamp_pb2

from tollgate.structure import Structure, chat_message_of, tool_call_message
from tollgate.types import (
    ApiKey,
    ChatMessage,
    LedgerEntry,
    LimitUsage,
    Model,
    Quota,
    RateLimits,
    Reconciliation,
    Run,
    RunEvent,
    Tenant,
    TokenLogprob,
    TopLogprob,
    Usage,
    UsageLine,
    UsageReport,
)
from tollgate.v1 import admin_pb2, events_pb2, gateway_pb2, ledger_pb2

PRIORITIES = {
    "interactive": events_pb2.PRIORITY_INTERACTIVE,
    "batch": events_pb2.PRIORITY_BATCH,
}


def state_name(value: int) -> str:
    """RUN_STATE_QUEUED -> "queued"; an unknown number -> "unspecified"."""
    try:
        name = events_pb2.RunState.Name(value)
    except ValueError:
        return "unspecified"
    return name.removeprefix("RUN_STATE_").lower()


def priority_name(value: int) -> str:
    try:
        name = events_pb2.Priority.Name(value)
    except ValueError:
        return "unspecified"
    return name.removeprefix("PRIORITY_").lower()


def to_datetime(message: timestamp_pb2.Timestamp, present: bool) -> datetime | None:
    return message.ToDatetime(tzinfo=UTC) if present else None


def to_timestamp(value: datetime) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    # A naive datetime is taken as UTC, the unit every Tollgate timestamp uses.
    stamp.FromDatetime(value if value.tzinfo else value.replace(tzinfo=UTC))
    return stamp


def to_duration(seconds: float) -> duration_pb2.Duration:
    duration = duration_pb2.Duration()
    duration.FromNanoseconds(int(seconds * 1e9))
    return duration


def usage_of(message: events_pb2.Usage) -> Usage:
    return Usage(
        prompt_tokens=message.prompt_tokens,
        cached_prompt_tokens=message.cached_prompt_tokens,
        output_tokens=message.output_tokens,
        kv_blocks_peak=message.kv_blocks_peak,
        kv_block_seconds=message.kv_block_seconds,
    )


def ledger_entry_of(message: events_pb2.LedgerEntry) -> LedgerEntry:
    return LedgerEntry(
        entry_id=message.entry_id,
        tenant_id=message.tenant_id,
        run_id=message.run_id,
        idempotency_key=message.idempotency_key,
        billing_type=message.billing_type,
        quantity=message.quantity,
        unit_price_micros=message.unit_price_micros,
        amount_micros=message.amount_micros,
        create_time=to_datetime(message.create_time, message.HasField("create_time")),
        discount_micros=message.discount_micros,
    )


def event_of(message: events_pb2.RunEvent) -> RunEvent:
    """The dataclass form of a RunEvent message."""
    kind = message.WhichOneof("kind") or state_name(message.state)
    base = RunEvent(
        run_id=message.run_id,
        seq=message.seq,
        state=state_name(message.state),
        kind=kind,
        tenant_id=message.tenant_id,
        time=to_datetime(message.time, message.HasField("time")),
        live=message.live,
    )
    return _with_kind_fields(base, message)


def _with_kind_fields(base: RunEvent, message: events_pb2.RunEvent) -> RunEvent:
    kind = message.WhichOneof("kind")
    if kind == "queued":
        q = message.queued
        return replace(
            base,
            model=q.model,
            priority=priority_name(q.priority),
            prompt_token_ids=tuple(q.prompt_token_ids),
            requeue_reason=q.requeue_reason,
        )
    if kind == "prefill":
        p = message.prefill
        return replace(base, worker_id=p.worker_id, cached_prompt_tokens=p.cached_prompt_tokens)
    if kind == "streaming":
        s = message.streaming
        logprobs = tuple(token_logprob_of(x) for x in s.logprobs)
        return replace(
            base,
            text=s.text,
            token_ids=tuple(s.token_ids),
            logprobs=logprobs,
            prompt_logprobs=tuple(token_logprob_of(x) for x in s.prompt_logprobs),
            index=s.index,
            finish_reason=s.finish_reason,
            at=(s.at[0], s.at[1]) if len(s.at) == 2 else None,
        )
    if kind == "completed":
        c = message.completed
        return replace(
            base,
            finish_reason=c.finish_reason,
            usage=usage_of(c.usage),
            ttft_seconds=c.ttft_seconds,
        )
    if kind == "failed":
        f = message.failed
        return replace(base, error_code=f.code, error_message=f.message, usage=usage_of(f.usage))
    if kind == "cancelled":
        c2 = message.cancelled
        return replace(base, cancel_reason=c2.reason, usage=usage_of(c2.usage))
    if kind == "billed":
        b = message.billed
        entries = tuple(ledger_entry_of(e) for e in b.entries)
        return replace(base, amount_micros=b.amount_micros, currency=b.currency, entries=entries)
    return base


def token_logprob_of(message: events_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(
        token_id=message.token_id,
        logprob=message.logprob,
        top=tuple(TopLogprob(t.token_id, t.logprob) for t in message.top),
    )


def run_of(message: events_pb2.Run) -> Run:
    return Run(
        run_id=message.run_id,
        tenant_id=message.tenant_id,
        model=message.model,
        state=state_name(message.state),
        last_seq=message.last_seq,
        usage=usage_of(message.usage) if message.HasField("usage") else None,
        idempotency_key=message.idempotency_key,
        finish_reason=message.finish_reason,
        priority=priority_name(message.priority),
        create_time=to_datetime(message.create_time, message.HasField("create_time")),
        update_time=to_datetime(message.update_time, message.HasField("update_time")),
    )


def model_of(message: gateway_pb2.Model) -> Model:
    return Model(name=message.name, base=message.base, context_length=message.context_length)


def quota_of(message: admin_pb2.Quota) -> Quota:
    return Quota(
        tenant_id=message.tenant_id,
        max_kv_blocks=message.max_kv_blocks,
        max_concurrent_runs=message.max_concurrent_runs,
        max_concurrent_streams=message.max_concurrent_streams
        if message.HasField("max_concurrent_streams")
        else None,
        requests_per_minute=message.requests_per_minute,
        input_tokens_per_minute=message.input_tokens_per_minute,
        output_tokens_per_minute=message.output_tokens_per_minute,
        budget_micros=message.budget_micros,
        budget_period=message.budget_period or "month",
        key_id=message.key_id,
    )


def tenant_of(message: admin_pb2.Tenant) -> Tenant:
    quota = quota_of(message.quota) if message.HasField("quota") else None
    return Tenant(
        tenant_id=message.tenant_id,
        name=message.name,
        weight=message.weight,
        quota=quota,
        key_quotas=tuple(quota_of(q) for q in message.key_quotas),
    )


def api_key_of(message: admin_pb2.ApiKey) -> ApiKey:
    def time(name: str) -> datetime | None:
        return to_datetime(getattr(message, name), message.HasField(name))

    return ApiKey(
        key_id=message.key_id,
        tenant_id=message.tenant_id,
        revoked=message.revoked,
        secret=message.secret,
        allowed_models=tuple(message.allowed_models),
        expire_time=time("expire_time"),
        alias=message.alias,
        last_used_time=time("last_used_time"),
        create_time=time("create_time"),
        previous_secret_expire_time=time("previous_secret_expire_time"),
    )


def usage_report_of(message: ledger_pb2.GetUsageResponse) -> UsageReport:
    return UsageReport(
        tenant_id=message.tenant_id,
        num_runs=message.num_runs,
        lines=tuple(
            UsageLine(
                billing_type=x.billing_type, quantity=x.quantity, amount_micros=x.amount_micros
            )
            for x in message.lines
        ),
        amount_micros=message.amount_micros,
        currency=message.currency,
        limits=tuple(limit_usage_of(x) for x in message.limits),
    )


def limit_usage_of(message: ledger_pb2.LimitUsage) -> LimitUsage:
    return LimitUsage(
        subject=message.subject,
        name=message.name,
        limit=message.limit,
        used=message.used,
        remaining=message.remaining,
        reset_time=message.reset_time.ToDatetime(tzinfo=UTC)
        if message.HasField("reset_time")
        else None,
        budget_period=message.budget_period,
    )


def rate_limits_of(metadata: Sequence[tuple[str, str | bytes]] | None) -> RateLimits:
    """The `x-ratelimit-*` entries of a call's initial metadata."""
    found = {
        name.lower(): value.decode() if isinstance(value, bytes) else value
        for name, value in metadata or ()
    }

    def number(name: str) -> int | None:
        value = found.get(f"x-ratelimit-{name}", "")
        return int(value) if value.isdigit() else None

    return RateLimits(
        limit_requests=number("limit-requests"),
        remaining_requests=number("remaining-requests"),
        reset_requests=found.get("x-ratelimit-reset-requests", ""),
        limit_tokens=number("limit-tokens"),
        remaining_tokens=number("remaining-tokens"),
        reset_tokens=found.get("x-ratelimit-reset-tokens", ""),
    )


def reconciliation_of(message: ledger_pb2.Reconciliation) -> Reconciliation:
    return Reconciliation(
        ok=message.ok,
        unbilled_run_ids=tuple(message.unbilled_run_ids),
        unreleased_run_ids=tuple(message.unreleased_run_ids),
        mismatched_run_ids=tuple(message.mismatched_run_ids),
        stuck_run_ids=tuple(message.stuck_run_ids),
    )


@dataclass(frozen=True, slots=True)
class Penalties:
    """The penalties and biases of a run; None (or empty) leaves one off."""

    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logit_bias: Mapping[int, float] | None = None

    def fields(self) -> dict[str, Any]:
        """SamplingParams' fields for those set."""
        found: dict[str, Any] = {
            name: getattr(self, name)
            for name in ("frequency_penalty", "presence_penalty", "repetition_penalty", "min_p")
            if getattr(self, name) is not None
        }
        if self.logit_bias:
            found["logit_bias"] = {int(token): float(b) for token, b in self.logit_bias.items()}
        return found


def generate_request(
    prompt: str | None,
    *,
    messages: Sequence[ChatMessage | tuple[str, str] | Mapping[str, Any]] | None,
    model: str,
    max_tokens: int,
    temperature: float | None,
    top_k: int | None,
    top_p: float | None,
    seed: int | None,
    stop: Sequence[str],
    stop_token_ids: Sequence[int],
    priority: str,
    ignore_eos: bool = False,
    penalties: Penalties | None = None,
    structure: Structure | None = None,
    logprobs: bool = False,
    top_logprobs: int = 0,
    n: int | None = None,
    prompt_logprobs: bool = False,
    idempotency_key: str | None,
    disconnect_grace: float | None,
    until_terminal: bool,
) -> events_pb2.GenerateRequest:
    """A GenerateRequest; the idempotency key is a fresh UUID unless one is given.
    A malformed argument raises ValueError naming it."""
    if priority not in PRIORITIES:
        raise ValueError(f"priority must be one of {sorted(PRIORITIES)}, got {priority!r}")
    if isinstance(stop, str):
        stop = [stop]
    sampling = events_pb2.SamplingParams(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        max_tokens=max_tokens,
        stop=list(stop),
        stop_token_ids=list(stop_token_ids),
        ignore_eos=ignore_eos,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        n=n,
        prompt_logprobs=prompt_logprobs,
        **(penalties or Penalties()).fields(),
        **(structure or Structure()).fields(),
    )
    request = events_pb2.GenerateRequest(
        model=model,
        prompt=prompt or "",
        messages=[_chat_message(f"messages[{i}]", m) for i, m in enumerate(messages or ())],
        sampling=sampling,
        priority=PRIORITIES[priority],
        idempotency_key=idempotency_key or str(uuid.uuid4()),
        until_terminal=until_terminal,
        # The stream tracker places live events by where their tokens start.
        live=True,
    )
    if disconnect_grace is not None:
        request.disconnect_grace.CopyFrom(to_duration(disconnect_grace))
    return request


def _chat_message(
    where: str, message: ChatMessage | tuple[str, str] | Mapping[str, Any]
) -> events_pb2.ChatMessage:
    if isinstance(message, ChatMessage):
        return events_pb2.ChatMessage(
            role=message.role,
            content=message.content,
            tool_calls=[tool_call_message(c) for c in message.tool_calls],
            tool_call_id=message.tool_call_id,
        )
    if isinstance(message, Mapping):
        return chat_message_of(where, message)
    role, content = message
    return events_pb2.ChatMessage(role=role, content=content)


def usage_request(
    tenant_id: str, start: datetime | None, end: datetime | None
) -> ledger_pb2.GetUsageRequest:
    request = ledger_pb2.GetUsageRequest(tenant_id=tenant_id)
    if start is not None:
        request.start_time.CopyFrom(to_timestamp(start))
    if end is not None:
        request.end_time.CopyFrom(to_timestamp(end))
    return request
