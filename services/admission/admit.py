"""Admitting a run: quotas, KV reservation and the `queued` event, in one transaction."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from sqlalchemy.ext.asyncio import AsyncConnection

from services.admission.attachment_store import attach_in
from services.admission.rate_headers import rate_limit_headers
from services.admission.requests import GenerateParams
from services.core.db import Database, driver_cursor
from services.core.errors import ApiError, NotFound
from services.core.event_store import Append, append_in
from services.core.quota_store import (
    Snapshot,
    Subject,
    TenantLimits,
    load_limits,
    subjects,
    usage_now,
)
from services.core.quotas import Demand
from services.core.runs import NewEvent, NewRun, RunState, StoredEvent


@dataclass(frozen=True, slots=True)
class Admission:
    run_id: str
    tenant_id: str
    params: GenerateParams
    prompt_token_ids: list[int]
    num_kv_blocks: int
    traceparent: str = ""
    # The admission replica that streams the run first: it holds the run's first lease.
    replica_id: str = ""
    key_id: str = ""  # the API key it came with, whose own limits apply too
    # The most the run can cost at the model's prices; None: the model has no price.
    spend_micros: int | None = 0

    def demand(self) -> Demand:
        return Demand(
            input_tokens=len(self.prompt_token_ids),
            output_tokens=self.params.sampling.max_tokens * self.params.sampling.n,
            num_kv_blocks=self.num_kv_blocks,
            spend_micros=self.spend_micros,
        )

    @property
    def idempotency_key(self) -> str:
        return self.params.idempotency_key or f"run:{self.run_id}"

    def queued_payload(self) -> dict[str, object]:
        return {
            "model": self.params.model,
            "priority": f"PRIORITY_{self.params.priority.upper()}",
            "sampling": self.params.sampling.payload(),
            "prompt_token_ids": self.prompt_token_ids,
            "idempotency_key": self.idempotency_key,
            "num_kv_blocks": self.num_kv_blocks,
        }


@dataclass(frozen=True, slots=True)
class Admitted:
    """What admitting stored: enough for the scheduler to queue the run as it is."""

    admission: Admission
    queued: StoredEvent
    tenant_weight: int
    # The x-ratelimit-* answer metadata (empty when no rate limit applies).
    rate_limits: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Held:
    """The tenant's and its key's limits and what they hold now, read under the tenant's
    row lock inside the transaction that would store the run."""

    conn: AsyncConnection
    limits: TenantLimits
    subjects: Sequence[Subject]
    snapshot: Snapshot


async def admit(
    db: Database, admission: Admission, refuse: Callable[[Held], Awaitable[ApiError | None]]
) -> Admitted:
    """Appends `queued`, then asks `refuse` (the quota checks, checks.py) and reserves the
    run's KV blocks, tokens and worst-case spend.

    Raises the refusal, or IdempotencyKeyTaken when another run holds the key. The
    tenant row lock serializes this tenant's (and its keys') admissions, so it is taken
    last: held for the usage read, the reservation and the commit, not the whole
    transaction.
    """
    async with db.begin() as conn:
        new_run = NewRun(
            tenant_id=admission.tenant_id,
            model=admission.params.model,
            priority=admission.params.priority,
            idempotency_key=admission.idempotency_key,
            request_hash=admission.params.request_hash(),
        )
        event = NewEvent(RunState.QUEUED, admission.queued_payload())
        [queued] = await append_in(
            conn, Append(admission.run_id, 0, [event], new_run, None, admission.traceparent)
        )
        reserved = await _reserve(conn, admission, refuse)
        if admission.replica_id:
            await attach_in(
                conn, admission.run_id, admission.replica_id, admission.params.disconnect_grace
            )
    return Admitted(admission, queued, reserved.weight, reserved.rate_limits)


# The run's reservation, stamped with the instant its usage was read at (so each
# window the run counts in held no more than the limit when it was admitted), and its
# worst-case spend charged to each budget it counts against, in subject order (the
# order billing takes the same rows in).
_RESERVE = """
    WITH reserved AS (
        INSERT INTO kv_reservations (run_id, tenant_id, key_id, num_kv_blocks, input_tokens,
                                     output_tokens, spend_micros, tenant_budget_start,
                                     key_budget_start, reserved_at)
        VALUES (%(run_id)s, %(tenant_id)s, %(key_id)s, %(num_kv_blocks)s, %(input_tokens)s,
                %(output_tokens)s, %(spend_micros)s, %(tenant_budget_start)s,
                %(key_budget_start)s, %(now)s)
    )
    INSERT INTO budget_spend (subject, period_start, spent_micros)
    SELECT * FROM unnest(%(subjects)s::text[], %(starts)s::timestamptz[], %(amounts)s::bigint[])
    ORDER BY 1
    ON CONFLICT (subject, period_start)
    DO UPDATE SET spent_micros = budget_spend.spent_micros + excluded.spent_micros
"""


@dataclass(frozen=True, slots=True)
class Reserved:
    weight: int
    rate_limits: dict[str, str]


async def _reserve(
    conn: AsyncConnection,
    admission: Admission,
    refuse: Callable[[Held], Awaitable[ApiError | None]],
) -> Reserved:
    """Reserves the run unless `refuse` refuses it within the tenant's and key's limits."""
    limits = await load_limits(conn, admission.tenant_id, admission.key_id, lock=True)
    if limits is None:
        raise NotFound(f"tenant {admission.tenant_id} does not exist")
    demand = admission.demand()
    of = subjects(admission.tenant_id, admission.key_id, limits)
    snapshot = await usage_now(conn, of)
    refused = await refuse(Held(conn, limits, of, snapshot))
    if refused is not None:
        raise refused
    charged = [
        (subject, start)
        for subject, start in zip(of, snapshot.period_starts, strict=True)
        if subject.limits.budget_micros
    ]
    starts = {subject.column: start for subject, start in charged}
    async with driver_cursor(conn) as cursor:
        await cursor.execute(
            _RESERVE,
            {
                "run_id": admission.run_id,
                "tenant_id": admission.tenant_id,
                "key_id": admission.key_id,
                "num_kv_blocks": demand.num_kv_blocks,
                "input_tokens": demand.input_tokens,
                "output_tokens": demand.output_tokens,
                "spend_micros": demand.spend_micros or 0,
                "tenant_budget_start": starts.get("tenant_id"),
                "key_budget_start": starts.get("key_id"),
                "now": snapshot.now,
                "subjects": [subject.subject for subject, _ in charged],
                "starts": [start for _, start in charged],
                "amounts": [demand.spend_micros or 0 for _ in charged],
            },
        )
    return Reserved(limits.weight, rate_limit_headers(snapshot.usages, demand))
