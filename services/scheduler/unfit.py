"""Queued runs the fleet can no longer hold: it shrank below what they need.

Admission refuses a run larger than the largest pool serving its model, but a run
admitted before the fleet shrank would wait in `queued` for ever. Once live workers
serve its model and none of them could hold it, for `grace` seconds (long enough for a
large worker that restarts to come back), it ends `failed` REJECTED, with a message
naming the reason. A model no live worker serves is waited for: that is an outage.
"""

from __future__ import annotations

import structlog

from services.core.event_store import EventStore
from services.core.runs import EventStoreError, NewEvent, RunState
from services.scheduler.dispatcher import REJECTED
from services.scheduler.records import QueuedRun
from services.scheduler.state import SchedulerState

log = structlog.get_logger(__name__)


class UnfitRuns:
    def __init__(self, state: SchedulerState, store: EventStore, grace: float) -> None:
        self.state = state
        self.store = store
        self.grace = grace
        # run_id -> when it was first found unfit (monotonic seconds)
        self.unfit_since: dict[str, float] = {}

    async def check(self, now: float) -> None:
        """Fails the runs unfit for `grace` seconds by `now`."""
        unfit = {run.run_id: run for run in self.state.never_fitting()}
        self.unfit_since = {r: self.unfit_since.get(r, now) for r in unfit}
        for run_id, since in list(self.unfit_since.items()):
            if now - since >= self.grace:
                del self.unfit_since[run_id]
                await self._fail(unfit[run_id])

    async def _fail(self, run: QueuedRun) -> None:
        if self.state.dequeue(run.run_id) is None:
            return  # dispatched or ended meanwhile
        largest = self.state.registry.max_run_tokens().get(run.model, 0)
        num_tokens = len(run.prompt_token_ids) + int(run.sampling.get("max_tokens", 0) or 0)
        message = (
            f"no live worker serving {run.model} can hold the run: it needs {num_tokens} "
            f"tokens of KV cache, the largest pool holds {largest}"
        )
        failed = NewEvent(
            RunState.FAILED,
            {
                "code": REJECTED,
                "message": message,
                "usage": {"prompt_tokens": len(run.prompt_token_ids)},
            },
        )
        try:
            await self.store.append(run.run_id, run.last_seq, [failed])
        except EventStoreError as error:  # it moved on; the next scan queues it if need be
            log.info("unfit run not failed", run_id=run.run_id, error=str(error))
            return
        self.state.forget(run.run_id)
        log.warning("run failed: no worker can hold it", run_id=run.run_id, needs=num_tokens)
