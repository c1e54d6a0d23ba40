"""Refusing new runs while the scheduler's queue is full, or while one tenant holds its
share of it.

The queue bound alone lets one tenant with no quota fill the queue, after which every
other tenant is refused too. So each tenant may hold at most its share of the queue's
runs: `max(min_share, share × max_queue_depth)` of them. The tenant's queued runs are
only counted once the whole queue holds more than one share, so an uncrowded queue costs
no query.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import sqlalchemy as sa

from services.core.db import Database, single_statement
from services.core.errors import ApiError, QuotaExceeded, Unavailable
from services.core.schema import runs

QUEUE_FULL_RETRY_SECONDS = 1.0
SHARE_RETRY_SECONDS = 2.0


@dataclass(frozen=True, slots=True)
class QueueBounds:
    max_queue_depth: int = 10_000
    # The fraction of `max_queue_depth` one tenant may hold queued, and its floor in runs.
    tenant_share: float = 0.5
    min_tenant_share: int = 100

    def runs_per_tenant(self) -> int:
        share = max(self.min_tenant_share, math.ceil(self.tenant_share * self.max_queue_depth))
        return min(share, self.max_queue_depth)


def queue_refusal(bounds: QueueBounds, depth: int) -> ApiError | None:
    """The refusal of any new run when the queue holds `depth` runs."""
    if depth > bounds.max_queue_depth:
        return Unavailable("the queue is full; retry later", retry_after=QUEUE_FULL_RETRY_SECONDS)
    return None


def may_hold_a_share(bounds: QueueBounds, depth: int) -> bool:
    """Whether some tenant may hold its whole share of a queue of `depth` runs."""
    return depth >= bounds.runs_per_tenant()


def share_refusal(bounds: QueueBounds, tenant_id: str, num_queued: int) -> ApiError | None:
    """The refusal of a new run for a tenant that has `num_queued` runs queued."""
    share = bounds.runs_per_tenant()
    if num_queued < share:
        return None
    return QuotaExceeded(
        f"queue share: {num_queued} of this tenant's {share} queued runs "
        f"(its share of a queue of {bounds.max_queue_depth}); retry later",
        subject=f"tenant:{tenant_id}:queued_runs",
        retry_after=SHARE_RETRY_SECONDS,
        reason="CONCURRENCY_LIMITED",
    )


async def num_queued(db: Database, tenant_id: str, at_most: int) -> int:
    """The tenant's queued runs, counted up to `at_most` (index `runs_tenant_queued`)."""
    some = (
        sa.select(sa.literal(1))
        .where(runs.c.tenant_id == tenant_id, runs.c.state == "queued")
        .limit(at_most)
        .subquery()
    )
    async with single_statement(db) as conn:
        return int(await conn.scalar(sa.select(sa.func.count()).select_from(some)) or 0)


async def overload_refusal(
    db: Database, bounds: QueueBounds, depth: int, tenant_id: str
) -> ApiError | None:
    """Why a new run of `tenant_id` is refused while the queue holds `depth`; None: admit."""
    refused = queue_refusal(bounds, depth)
    if refused is not None or not may_hold_a_share(bounds, depth):
        return refused
    queued = await num_queued(db, tenant_id, bounds.runs_per_tenant())
    return share_refusal(bounds, tenant_id, queued)
