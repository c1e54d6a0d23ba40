"""Keeps the run → worker assignments in line with the `runs` projection.

Kafka terminal events end assignments quickly; this check makes sure they end
even when Kafka lost the event.  It also adopts runs that workers are running
but the scheduler does not know of (it restarted): their owner is the worker,
so a cancel can be forwarded and the worker's loss handled.
"""

from __future__ import annotations

import time

import structlog

from services.core.runs import RunState
from services.scheduler.records import SCHEDULER_OWNER, Assignment, RunStatus
from services.scheduler.scheduler_store import SchedulerStore
from services.scheduler.state import SchedulerState

log = structlog.get_logger(__name__)


class AssignmentTracker:
    def __init__(self, state: SchedulerState, scheduler_store: SchedulerStore) -> None:
        self.state = state
        self.scheduler_store = scheduler_store

    async def sync(self) -> None:
        await self._end_finished()
        await self._adopt_active()

    async def _end_finished(self) -> None:
        snapshot = dict(self.state.assignments)
        statuses = await self.scheduler_store.statuses(snapshot)
        for run_id, assignment in snapshot.items():
            status = statuses.get(run_id)
            if status is None or not _still_assigned(status, assignment):
                self.state.forget(run_id, assignment.lease_epoch)

    async def _adopt_active(self) -> None:
        for run_id, status in (await self.scheduler_store.active_runs()).items():
            if not self.state.knows(run_id) and status.owner:
                self.state.assignments[run_id] = _adopted(status)
                log.info("run adopted", run_id=run_id, worker_id=status.owner)


def _still_assigned(status: RunStatus, assignment: Assignment) -> bool:
    if status.has_ended or status.lease_epoch != assignment.lease_epoch:
        return False  # ended, or leased by someone else since (they own it now)
    # A queued run under the scheduler's own lease was re-queued: the queue takes it.
    return not (status.state == RunState.QUEUED and assignment.worker_id == SCHEDULER_OWNER)


def _adopted(status: RunStatus) -> Assignment:
    assert status.owner is not None
    return Assignment(
        run_id=status.run_id,
        tenant_id=status.tenant_id,
        worker_id=status.owner,
        lease_epoch=status.lease_epoch,
        since=time.monotonic(),
        last_seq=status.last_seq,
    )
