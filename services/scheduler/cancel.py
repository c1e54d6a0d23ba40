"""CancelRun: a queued run ends `cancelled` here; a running one at its worker."""

from __future__ import annotations

import structlog

from services.core.event_store import ConcurrencyConflict, EventStore
from services.core.runs import IllegalTransition, NewEvent, RunState
from services.scheduler.records import QueuedRun
from services.scheduler.scheduler_store import SchedulerStore
from services.scheduler.state import SchedulerState
from services.scheduler.worker_client import WorkerClients

log = structlog.get_logger(__name__)

MAX_ATTEMPTS = 5
# Admission waits 3 s for the whole CancelRun; a dispatch in flight gets part of that.
DISPATCH_SETTLE_TIMEOUT = 1.0
DEFAULT_REASON = "cancelled"


class Canceller:
    def __init__(
        self,
        state: SchedulerState,
        store: EventStore,
        scheduler_store: SchedulerStore,
        clients: WorkerClients,
    ) -> None:
        self.state = state
        self.store = store
        self.scheduler_store = scheduler_store
        self.clients = clients

    async def cancel(self, run_id: str, reason: str) -> bool:
        """Ends or forwards the cancel of `run_id`; False if unknown or already ended."""
        reason = reason or DEFAULT_REASON
        await self.state.wait_settled(run_id, DISPATCH_SETTLE_TIMEOUT)
        assignment = self.state.assignments.get(run_id)
        if assignment is not None:
            return await self._forward(assignment.worker_id, run_id, reason)
        queued = self.state.dequeue(run_id)
        if run_id in self.state.settling:
            return False  # its lost worker is being dealt with right now
        self.state.settling.add(run_id)
        try:
            return await self._cancel_queued(run_id, reason, queued)
        finally:
            self.state.settling.discard(run_id)

    async def _cancel_queued(self, run_id: str, reason: str, queued: QueuedRun | None) -> bool:
        # Decided again after every conflict: the run may have moved on meanwhile.
        for _ in range(MAX_ATTEMPTS):
            run = await self.store.get_run(run_id)
            if run is None or run.state not in (
                RunState.QUEUED,
                RunState.PREFILL,
                RunState.STREAMING,
            ):
                return False
            if run.state != RunState.QUEUED:
                return await self._forward(run.owner, run_id, reason)
            if queued is None or queued.last_seq != run.last_seq:
                loaded = await self.scheduler_store.load_queued([run_id])
                queued = loaded[0] if loaded else None
                if queued is None:
                    continue
            try:
                await self.store.append(run_id, run.last_seq, [_cancelled(queued, reason)])
            except (ConcurrencyConflict, IllegalTransition):
                continue
            log.info("queued run cancelled", run_id=run_id, tenant_id=queued.tenant_id)
            return True
        return False

    async def _forward(self, worker_id: str | None, run_id: str, reason: str) -> bool:
        worker = self.state.registry.get(worker_id) if worker_id else None
        if worker is None:
            return False
        found = await self.clients.cancel(worker.address, run_id, reason)
        return bool(found)


def _cancelled(run: QueuedRun, reason: str) -> NewEvent:
    return NewEvent(
        RunState.CANCELLED,
        {"reason": reason, "usage": {"prompt_tokens": len(run.prompt_token_ids)}},
    )
