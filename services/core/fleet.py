"""The scheduler's answer to admission (`SchedulerService.GetQueueStats`): its queues and
its workers, one `WorkerLoad` a row. The scheduler fills the rows; admission's checks
and its console read the whole as a `FleetView`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from services.core.shares import TenantLoad

INTERACTIVE, BATCH = "interactive", "batch"


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """One worker as the scheduler last heard from it, with the runs assigned to it."""

    worker_id: str
    model: str  # "" = serves whatever it is sent
    num_free_blocks: int
    num_total_blocks: int  # 0 = not reported yet
    num_running: int
    alive: bool
    draining: bool
    suspect: bool
    engine_kind: str = ""  # what serves its tokens; "" = not reported
    # Each tenant's runs there as last reported: its part of the worker; and whether it
    # suspends runs to make room for a tenant under its share (services/core/shares.py).
    tenants: tuple[TenantLoad, ...] = ()
    suspends_runs: bool = False


@dataclass(frozen=True, slots=True)
class FleetView:
    """The interface between the scheduler's answer and admission's checks: the queues
    and the fleet's KV blocks as the scheduler last reported them, without the protobuf or
    the polling behind them.

    The empty view stands for a scheduler that does not answer, and refuses nothing: no
    run queued, a fleet of unknown size, no model known to be served."""

    num_interactive: int = 0
    num_batch: int = 0
    num_running: int = 0
    num_workers: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0  # 0: no live worker known
    # The blocks the queued runs of each class need.
    num_queued_interactive_blocks: int = 0
    num_queued_batch_blocks: int = 0
    # model -> the most tokens (prompt + max_tokens) one run may hold on any live worker
    # serving it; a model absent is not known to be served yet.
    max_run_tokens: Mapping[str, int] = field(default_factory=dict)
    workers: tuple[WorkerLoad, ...] = ()

    @property
    def num_queued_runs(self) -> int:
        return self.num_interactive + self.num_batch

    def num_queued(self, priority: str) -> int:
        return self.num_batch if priority == BATCH else self.num_interactive

    def engine_kinds(self, model: str) -> frozenset[str]:
        """What serves the tokens of the live workers whose base model is `model`, as far
        as they said."""
        return frozenset(
            w.engine_kind for w in self.workers if w.alive and w.model == model and w.engine_kind
        )

    def within_share(self, tenant_id: str) -> bool:
        """Whether the tenant holds less than an even part of the blocks of the dispatchable
        workers that suspend runs for a tenant's share, among the tenants with runs there
        and itself: an interactive run of it is then likely to find room there by the share
        rule, whatever waits in the queue (the scheduler decides with each tenant's
        weight and the run's size)."""
        workers = [
            w for w in self.workers if w.alive and not (w.draining or w.suspect) and w.suspends_runs
        ]
        holders = {t.tenant_id for w in workers for t in w.tenants if t.num_runs} | {tenant_id}
        held = sum(t.num_kv_blocks for w in workers for t in w.tenants if t.tenant_id == tenant_id)
        total = sum(w.num_total_blocks for w in workers)
        return len(holders) > 1 and held * len(holders) < total

    def free_kv(self, priority: str) -> float | None:
        """Free blocks less those queued ahead of a new run of `priority`, as a fraction
        of the fleet's blocks; None when the fleet's size is not known."""
        if self.num_total_blocks <= 0:
            return None
        ahead = self.num_queued_interactive_blocks
        if priority == BATCH:
            ahead += self.num_queued_batch_blocks
        return (self.num_free_blocks - ahead) / self.num_total_blocks
