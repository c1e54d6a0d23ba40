"""Refusing new runs while the fleet is overloaded: bounded queues, KV watermarks and each
tenant's share of the queue.

Degradation comes in steps. Each priority class has its own queue bound, and the whole
queue one more. Then the fleet's free KV: the blocks the live workers have free, less
those the runs queued ahead of a new run need (for a batch run every queued run, for an
interactive run the interactive ones: they go first), as a fraction of the fleet's
blocks. 1 is an idle fleet, 0 a full one with nothing waiting, -1 a fleet's worth of
blocks waiting. Below `batch_kv_watermark` batch runs are refused (UNAVAILABLE with a
retry delay) while interactive runs are still admitted; below the lower
`interactive_kv_watermark` interactive runs are refused too.

The bounds alone let one tenant with no quota fill the queue, after which every other
tenant is refused too. So each tenant may hold at most its share of the queue's runs:
`max(min_share, share × max_queue_depth)` of them. The tenant's queued runs are only
counted once the whole queue holds more than one share, so an uncrowded queue costs no
query.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.core.config import ConfigError
from services.core.errors import ApiError, QuotaExceeded, Unavailable
from services.core.fleet import BATCH, FleetView

QUEUE_FULL_RETRY_SECONDS = 1.0
SHARE_RETRY_SECONDS = 2.0
# Under a KV watermark the queue drains at the pace runs finish: seconds, not instants.
KV_RETRY_SECONDS = 5.0


@dataclass(frozen=True, slots=True)
class QueueBounds:
    """How many runs the queue, each class and each tenant may hold, and the free KV under
    which each class is refused (TOLLGATE_MAX_QUEUE_DEPTH and the rest of its settings)."""

    max_queue_depth: int = 10_000
    # The fraction of `max_queue_depth` one tenant may hold queued, and its floor in runs.
    tenant_share: float = 0.5
    min_tenant_share: int = 100
    # Per class; 0: only `max_queue_depth` bounds it.
    max_interactive_depth: int = 0
    max_batch_depth: int = 0
    # Free KV (see the module docstring) under which runs of the class are refused.
    batch_kv_watermark: float = -1.0
    interactive_kv_watermark: float = -2.0

    def __post_init__(self) -> None:
        if self.interactive_kv_watermark > self.batch_kv_watermark:
            raise ConfigError(
                "TOLLGATE_INTERACTIVE_KV_WATERMARK must not be above "
                "TOLLGATE_BATCH_KV_WATERMARK: batch runs are refused first"
            )

    def runs_per_tenant(self) -> int:
        share = max(self.min_tenant_share, math.ceil(self.tenant_share * self.max_queue_depth))
        return min(share, self.max_queue_depth)

    def max_class_depth(self, priority: str) -> int:
        bound = self.max_batch_depth if priority == BATCH else self.max_interactive_depth
        return bound or self.max_queue_depth

    def kv_watermark(self, priority: str) -> float:
        return self.batch_kv_watermark if priority == BATCH else self.interactive_kv_watermark


def queue_refusal(bounds: QueueBounds, depth: int) -> ApiError | None:
    """The refusal of any new run when the queue holds `depth` runs."""
    if depth > bounds.max_queue_depth:
        return Unavailable("the queue is full; retry later", retry_after=QUEUE_FULL_RETRY_SECONDS)
    return None


def class_refusal(
    bounds: QueueBounds, load: FleetView, priority: str, tenant_id: str = ""
) -> ApiError | None:
    """The refusal of a new run of `priority`: its class's queue is full, or the fleet's
    free KV is under the class's watermark, unless it is an interactive run of a tenant
    within its share of the workers that suspend runs for one (`FleetView.within_share`):
    another tenant's queue does not keep it out."""
    depth, bound = load.num_queued(priority), bounds.max_class_depth(priority)
    if depth > bound:
        return Unavailable(
            f"the {priority} queue is full ({depth} runs, bound {bound}); retry later",
            retry_after=QUEUE_FULL_RETRY_SECONDS,
        )
    free, watermark = load.free_kv(priority), bounds.kv_watermark(priority)
    if free is None or free >= watermark:
        return None
    if priority != BATCH and load.within_share(tenant_id):
        return None
    still = "; interactive runs are still admitted" if priority == BATCH else ""
    return Unavailable(
        f"the fleet is overloaded: free KV {free:.2f} of its {load.num_total_blocks} blocks "
        f"(less the queued runs' demand) is under the {priority} watermark {watermark:.2f}"
        f"{still}; retry later",
        retry_after=KV_RETRY_SECONDS,
    )


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
