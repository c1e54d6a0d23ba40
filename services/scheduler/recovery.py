"""Runs of a lost worker, or of a live one that no longer holds them: back to the
queue, or `failed` WORKER_LOST.

A run that emitted no `streaming` event may run again elsewhere: it gets a new
`queued` event (requeue_reason WORKER_LOST) and is dispatched anew, unless it
was re-queued too often already (REQUEUE_LIMIT, `services/core/requeue.py`).
A run whose worker did not store its `prefill` gets one first, so that every
attempt counts, however quickly the run took its worker down.
A run that streamed is never re-run (DESIGN §1): it ends `failed` WORKER_LOST
with the usage actually delivered.  Either way the scheduler first takes the
lease, so the lost worker, should it come back, is fenced off.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Sequence

import structlog

from services.core.event_store import ConcurrencyConflict, EventStore, StaleLease
from services.core.requeue import WORKER_LOST, latest, lost_run_events, prefill_event
from services.core.runs import IllegalTransition, NewEvent, RunState, StoredEvent
from services.core.telemetry import bound_log_context
from services.scheduler import metrics
from services.scheduler.records import SCHEDULER_OWNER, Assignment
from services.scheduler.state import SchedulerState

log = structlog.get_logger(__name__)

MAX_ATTEMPTS = 5
ACTIVE_STATES = (RunState.QUEUED, RunState.PREFILL, RunState.STREAMING)

Requeue = Callable[[Collection[str]], Awaitable[object]]


def lost_worker_events(
    events: Sequence[StoredEvent], worker_id: str, lease_epoch: int, why: str = "was lost"
) -> list[NewEvent]:
    """What settles a run whose worker was lost (or dropped it, as `why` says), appended
    under the scheduler's `lease_epoch`; nothing for a run that ended."""
    message = f"worker {worker_id} {why} after the run started streaming"
    return lost_run_events(events, WORKER_LOST, message, prefill_event(worker_id, lease_epoch))


class Recovery:
    def __init__(self, state: SchedulerState, store: EventStore, requeue: Requeue) -> None:
        self.state = state
        self.store = store
        self.requeue = requeue

    async def recover(self, assignment: Assignment, why: str = "was lost") -> None:
        """Settles one run of a lost worker (or one that dropped it: `why` says which, as
        in "worker w-1 {why}"); on error it stays assigned and is retried."""
        run_id = assignment.run_id
        if run_id in self.state.settling or self.state.assignments.get(run_id) != assignment:
            return  # being settled, or settled already
        self.state.settling.add(run_id)
        try:
            with bound_log_context(run_id=run_id, tenant_id=assignment.tenant_id):
                outcome = await self._settle(assignment, why)
        except Exception:
            log.exception("recovery failed; will retry", worker_id=assignment.worker_id)
            return
        finally:
            self.state.settling.discard(run_id)
        self.state.forget(run_id, assignment.lease_epoch)
        metrics.RUNS_RECOVERED.labels(outcome=outcome).inc()
        log.info("run of lost worker settled", worker_id=assignment.worker_id, outcome=outcome)
        if outcome == "requeued":
            await self.requeue([run_id])

    async def _settle(self, assignment: Assignment, why: str) -> str:
        for _ in range(MAX_ATTEMPTS):
            run = await self.store.get_run(assignment.run_id)
            if run is None or run.state not in ACTIVE_STATES:
                return "ended"
            epoch = await self.store.acquire_lease(assignment.run_id, SCHEDULER_OWNER)
            # Read after the lease: the lost worker cannot append any more.
            events = await self.store.read(assignment.run_id)
            if events[-1].kind == RunState.QUEUED and events[-1].seq != assignment.last_seq:
                return "requeued"  # its worker handed it back already
            settling = lost_worker_events(events, assignment.worker_id, epoch, why)
            if not settling:
                continue
            queued = latest(events, RunState.QUEUED)
            try:
                await self.store.append(
                    assignment.run_id,
                    events[-1].seq,
                    settling,
                    lease_epoch=epoch,
                    traceparent=queued.traceparent if queued else "",
                )
            except (ConcurrencyConflict, StaleLease, IllegalTransition):
                continue
            return "requeued" if settling[-1].kind == RunState.QUEUED else "failed"
        raise RuntimeError(f"run {assignment.run_id}: could not settle after {MAX_ATTEMPTS} tries")
