"""Appends what the engine steps produced: one transaction for all runs in them.

Every event costs the database, the relay, the broker and each consumer, so the
appender keeps the worker's event rate near `events_per_second` whatever the
number of runs: successive appends are `len(runs) / events_per_second` seconds
apart, kept between `min_interval` and `max_interval`, and the steps in between
become one `streaming` event per run. A run's first tokens and its end are
appended at once; its `prefill` waits for the first tokens, `min_interval` at
most. A run whose append is refused (its lease was taken over, or it was
cancelled elsewhere) is dropped from the engine, and the others go ahead. An
append whose commit reply was lost is retried; its runs' conflicts then read back
what committed, so they go on rather than being dropped.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence

import structlog
from sqlalchemy.exc import InterfaceError, OperationalError

from engine.outputs import RequestOutput
from services.core.event_store import Append, ConcurrencyConflict, EventStore
from services.core.loop import wait_set
from services.core.runs import EventStoreError, NewEvent, RunState
from services.worker.runs import AssignedRun, step_events
from services.worker.telemetry import run_finished

log = structlog.get_logger(__name__)

APPEND_FAILED = "the run's events could not be stored"

Step = Sequence[tuple[RequestOutput, AssignedRun | None]]


class StepAppender:
    def __init__(
        self,
        store: EventStore,
        runs: dict[str, AssignedRun],
        abort: Callable[[str], None],
        *,
        events_per_second: float = 100.0,
        min_interval: float = 0.05,
        max_interval: float = 0.25,
    ) -> None:
        self.store = store
        self.runs = runs
        self.abort = abort
        self.events_per_second = events_per_second
        self.min_interval = min_interval
        self.max_interval = max_interval
        # Each step's outputs with the attempt each was for: a run dropped and assigned
        # again must not be sent what its earlier attempt produced.
        self._steps: asyncio.Queue[Step] = asyncio.Queue()
        self._urgent = asyncio.Event()
        self._last_append = 0.0
        # `prefill` events of runs just assigned, appended ahead of their first tokens.
        self._starts: dict[str, NewEvent] = {}
        self._ended_watchers: list[asyncio.Event] = []

    def watch_ended(self) -> asyncio.Event:
        """An event set whenever runs end here and their blocks are free again; each
        watcher clears its own."""
        event = asyncio.Event()
        self._ended_watchers.append(event)
        return event

    def _runs_ended(self) -> None:
        for event in self._ended_watchers:
            event.set()

    def start(self, run_id: str, prefill: NewEvent) -> None:
        """Queues a newly assigned run's `prefill`. It goes out with the next append: the
        run's first tokens, another run's, or its own once `min_interval` has passed. A
        short prompt's two events share one transaction, and a lone run's prefill is
        computed with no append beside it."""
        self._starts[run_id] = prefill
        asyncio.get_running_loop().call_later(self.min_interval, self._start_due, run_id)

    def _start_due(self, run_id: str) -> None:
        if run_id in self._starts:
            self._urgent.set()
            self._steps.put_nowait(())

    def on_step(self, outputs: Sequence[RequestOutput]) -> None:
        """Called on the event loop with each step's outputs."""
        self._steps.put_nowait([(output, self.runs.get(output.request_id)) for output in outputs])
        if any(self._is_urgent(output) for output in outputs):
            self._urgent.set()

    def interval(self) -> float:
        """The least time between two appends for the runs held now."""
        spread = len(self.runs) / self.events_per_second if self.events_per_second > 0 else 0.0
        return min(self.max_interval, max(self.min_interval, spread))

    def _is_urgent(self, output: RequestOutput) -> bool:
        """A run's end, or its first tokens (time to first token is what clients wait on)."""
        run = self.runs.get(output.request_id)
        return output.finished or (run is not None and not run.streamed)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            steps = [await self._steps.get()]
            delay = self._last_append + self.interval() - loop.time()
            if delay > 0 and not self._urgent.is_set():
                await wait_set(self._urgent, delay)
            self._urgent.clear()
            while not self._steps.empty():
                steps.append(self._steps.get_nowait())
            try:
                await self._append_steps(steps)
            finally:
                for _ in steps:
                    self._steps.task_done()

    async def _append_steps(self, steps: Sequence[Step]) -> None:
        outputs = [
            output
            for step in steps
            for output, attempt in step
            if attempt is not None and self.runs.get(output.request_id) is attempt
        ]
        if not outputs and not self._starts:
            return  # a `prefill` that went out with its run's first tokens
        self._last_append = asyncio.get_running_loop().time()
        while True:
            try:
                await self.append(outputs)
                return
            except (OperationalError, InterfaceError) as error:
                # The database is away: keep the outputs and retry.
                log.error("step append failed, retrying", error=repr(error))
                await asyncio.sleep(0.5)
            except Exception as error:
                log.exception("step append failed for good", error=repr(error))
                failing = {o.request_id for o in outputs} | set(self._starts)
                # The batch spans several tenants' runs and the error's text may hold SQL
                # and their values: it stays in this log.
                await self.fail_runs(failing, APPEND_FAILED)
                return

    async def flush(self) -> None:
        """Returns once every step handed over so far is appended (or its runs failed)."""
        await self._steps.join()

    def release_all(self) -> list[AssignedRun]:
        """Takes every run off this appender: nothing more is appended for them, and
        `prefill` events not appended yet are dropped."""
        released = list(self.runs.values())
        self.runs.clear()
        self._starts.clear()
        return released

    async def append(self, outputs: Sequence[RequestOutput]) -> None:
        pending = self._events_by_run(outputs)
        stored: dict[str, tuple[list[NewEvent], bool]] = {}
        while pending:
            appends = [
                Append(run_id, self.runs[run_id].last_seq, events, lease_epoch=self.runs[run_id].lease_epoch,
                       traceparent=self.runs[run_id].traceparent)
                for run_id, (events, _) in pending.items()
            ]  # fmt: skip
            try:
                await self.store.append_batch(appends)
            except ConcurrencyConflict as error:
                if error.run_id not in pending:
                    raise
                if await self._is_stored(error.run_id, pending[error.run_id][0]):
                    # An earlier try committed and only its reply was lost: every run of
                    # that transaction holds its events already; the others go again.
                    await self._take_stored(pending, stored)
                else:
                    self._refused(pending, error)
                continue
            except EventStoreError as error:
                if getattr(error, "run_id", None) not in pending:
                    raise
                self._refused(pending, error)
                continue
            stored.update(pending)
            break
        ended = {output.request_id: output for output in outputs if output.finished}
        for run_id, (events, finished) in stored.items():
            self._starts.pop(run_id, None)
            run = self.runs[run_id]
            run.last_seq += len(events)
            run.streamed = run.streamed or any(e.kind != RunState.PREFILL for e in events)
            if finished:
                self.runs.pop(run_id, None)
                run_finished(run, ended[run_id])
        if any(finished for _, finished in stored.values()):
            self._runs_ended()

    def _refused(self, pending: dict[str, tuple[list[NewEvent], bool]], error: Exception) -> None:
        run_id = str(getattr(error, "run_id", ""))
        log.warning("append refused, dropping run", run_id=run_id, error=str(error))
        pending.pop(run_id)
        self.drop(run_id)

    async def _is_stored(self, run_id: str, events: Sequence[NewEvent]) -> bool:
        """Whether the run's next events in the store are `events` themselves."""
        found = await self.store.read(run_id, self.runs[run_id].last_seq, limit=len(events))
        return [(e.kind, e.payload) for e in found] == [
            (e.kind, json.loads(json.dumps(dict(e.payload)))) for e in events
        ]

    async def _take_stored(
        self,
        pending: dict[str, tuple[list[NewEvent], bool]],
        stored: dict[str, tuple[list[NewEvent], bool]],
    ) -> None:
        """Moves the runs whose events are in the store already from `pending` to `stored`."""
        run_ids = list(pending)
        found = await asyncio.gather(*(self._is_stored(r, pending[r][0]) for r in run_ids))
        for run_id, is_stored in zip(run_ids, found, strict=True):
            if is_stored:
                stored[run_id] = pending.pop(run_id)
        log.warning("append committed though its reply was lost", num_runs=len(stored))

    def _events_by_run(
        self, outputs: Sequence[RequestOutput]
    ) -> dict[str, tuple[list[NewEvent], bool]]:
        by_run: dict[str, list[RequestOutput]] = {
            run_id: [] for run_id in self._starts if run_id in self.runs
        }
        for output in outputs:
            if output.request_id in self.runs:
                by_run.setdefault(output.request_id, []).append(output)
        pending: dict[str, tuple[list[NewEvent], bool]] = {}
        for run_id, run_outputs in by_run.items():
            start = self._starts.get(run_id)
            events = [start] if start is not None else []
            events += step_events(self.runs[run_id], run_outputs)
            if events:
                pending[run_id] = (events, bool(run_outputs) and run_outputs[-1].finished)
        return pending

    async def fail_runs(self, run_ids: set[str], message: str) -> None:
        """Ends runs whose events could not be stored: each gets `failed`, best effort."""
        for run_id in run_ids:
            run = self.runs.pop(run_id, None)
            if run is None:
                continue
            self._runs_ended()
            self.abort(run_id)
            failed = NewEvent(RunState.FAILED, {"code": "INTERNAL", "message": message[:500]})
            start = self._starts.pop(run_id, None)
            events = [failed] if start is None else [start, failed]
            try:
                await self.store.append(run_id, run.last_seq, events, lease_epoch=run.lease_epoch)
            except Exception as error:  # the scheduler's recovery ends it instead
                log.error("could not fail run", run_id=run_id, error=repr(error))

    def drop(self, run_id: str) -> None:
        """Stops a run here: aborted in the engine, nothing more appended for it."""
        self._starts.pop(run_id, None)
        if self.runs.pop(run_id, None) is not None:
            self._runs_ended()
            self.abort(run_id)
