"""Cancelling a run, whatever state it is in; cancelling twice is harmless."""

from __future__ import annotations

import asyncio
import time

import structlog

from services.admission.scheduler_client import SchedulerClient
from services.core.event_store import ConcurrencyConflict, EventStore
from services.core.runs import (
    IllegalTransition,
    NewEvent,
    RunState,
    RunView,
    StoredEvent,
    is_ended,
)

log = structlog.get_logger(__name__)

WORKER_CANCEL_WAIT = 5.0


class Canceller:
    def __init__(self, store: EventStore, scheduler: SchedulerClient | None) -> None:
        self.store = store
        self.scheduler = scheduler

    async def cancel(self, run: RunView, reason: str) -> RunView:
        """Ends `run` as `cancelled` unless it already ended; returns the run afterwards."""
        if self.scheduler is not None and await self.scheduler.cancel(run.run_id, reason):
            ended = await self._wait_until_ended(run.run_id, WORKER_CANCEL_WAIT)
            if ended is not None:
                return ended
        # No scheduler, or it could not end the run in time: end it here.  Optimistic
        # concurrency settles any race with a worker still appending.
        while True:
            current = await self.store.get_run(run.run_id)
            assert current is not None
            if is_ended(current.state):
                return current
            try:
                await self.store.append(
                    current.run_id,
                    current.last_seq,
                    [
                        NewEvent(
                            RunState.CANCELLED,
                            {"reason": reason, "usage": await self._usage(current)},
                        )
                    ],
                )
            except (ConcurrencyConflict, IllegalTransition):
                continue

    async def _wait_until_ended(self, run_id: str, timeout: float) -> RunView | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            run = await self.store.get_run(run_id)
            if run is not None and is_ended(run.state):
                return run
            await asyncio.sleep(0.05)
        return None

    async def _usage(self, run: RunView) -> dict[str, int]:
        events = await self.store.read(run.run_id)
        return delivered_usage(events)


def delivered_usage(events: list[StoredEvent]) -> dict[str, int]:
    """Usage as far as the events show: prompt tokens and the tokens streamed."""
    prompt = next((e for e in events if e.kind == RunState.QUEUED), None)
    num_prompt = len(prompt.payload.get("prompt_token_ids", [])) if prompt else 0
    num_output = sum(
        len(e.payload.get("token_ids", [])) for e in events if e.kind == RunState.STREAMING
    )
    return {"prompt_tokens": num_prompt, "output_tokens": num_output}
