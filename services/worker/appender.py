"""Stores what the engine steps produced, each run at its own pace, and publishes its
tokens at once.

Every stored event costs the database, the relay, the broker and each consumer, so a
run's `streaming` events are stored every `store_tokens` tokens or `store_interval`
seconds, whichever comes first; its first tokens and its end at once; its `prefill`
with its first tokens, or alone once `min_interval` has passed. Between two of its
stores a run's tokens go to its streams live (`services.core.live`), once its first
tokens are stored. Appends carry every run that is due in one transaction, at most one
per `interval()` (`len(runs) / events_per_second`, kept between `min_interval` and
`max_interval`) unless a run's first tokens or end wait. A run whose append is refused
(its lease was taken over, or it was cancelled elsewhere) is dropped from the engine,
and the others go ahead. An append whose commit reply was lost is retried; its runs'
conflicts then read back what committed, so they go on rather than being dropped.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import structlog
from sqlalchemy.exc import InterfaceError, OperationalError

from engine.outputs import RequestOutput
from services.core.event_store import Append, ConcurrencyConflict, EventStore
from services.core.loop import wait_set
from services.core.runs import EventStoreError, NewEvent, RunState
from services.worker.runs import AssignedRun, output_end, step_events
from services.worker.telemetry import run_finished

log = structlog.get_logger(__name__)

APPEND_FAILED = "the run's events could not be stored"

# Sends a run's live pieces (`streaming` payloads) to its streams: run id, tenant id, pieces.
Publish = Callable[[str, str, Sequence[Mapping[str, Any]]], None]
Pending = dict[str, tuple[list[NewEvent], bool]]


class StepAppender:
    def __init__(
        self,
        store: EventStore,
        runs: dict[str, AssignedRun],
        abort: Callable[[str], None],
        *,
        publish: Publish | None = None,
        events_per_second: float = 100.0,
        min_interval: float = 0.05,
        max_interval: float = 0.25,
        store_tokens: int = 16,
        store_interval: float = 5.0,
    ) -> None:
        self.store = store
        self.runs = runs
        self.abort = abort
        self.publish = publish
        self.events_per_second = events_per_second
        self.min_interval = min_interval
        self.max_interval = max_interval
        self.store_tokens = store_tokens
        self.store_interval = store_interval
        self._wake = asyncio.Event()
        self._urgent = asyncio.Event()
        self._appending = asyncio.Lock()
        self._last_append = 0.0
        # `prefill` events of runs just assigned, appended ahead of their first tokens;
        # those whose `min_interval` has passed go out with the next append.
        self._starts: dict[str, NewEvent] = {}
        self._starts_due: set[str] = set()
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
            self._starts_due.add(run_id)
            self._urgent.set()
            self._wake.set()

    def on_step(self, outputs: Sequence[RequestOutput]) -> None:
        """Called on the event loop with each step's outputs: each joins its run's pending
        outputs (a run dropped meanwhile has none), and goes to its streams live."""
        now = asyncio.get_running_loop().time()
        by_run: dict[str, list[RequestOutput]] = {}
        for output in outputs:
            run = self.runs.get(output.request_id)
            if run is None:
                continue
            if not run.pending:
                run.pending_since = now
                self._wake.set()  # a deadline the loop has not counted yet
            run.pending.append(output)
            by_run.setdefault(output.request_id, []).append(output)
        for run_id, made in by_run.items():
            run = self.runs[run_id]
            at, run.made = run.made, output_end(run.made, made)
            if run.streamed:
                self._publish(run, made, at)
            if not run.streamed or made[-1].finished:
                self._urgent.set()
            if self._is_due(run, now):
                self._wake.set()

    def _publish(
        self, run: AssignedRun, outputs: Sequence[RequestOutput], at: tuple[int, int]
    ) -> None:
        if self.publish is None:
            return
        pieces = [e.payload for e in step_events(run, outputs, at) if e.kind == RunState.STREAMING]
        if pieces:
            self.publish(run.run_id, run.tenant_id, pieces)

    def interval(self) -> float:
        """The least time between two appends for the runs held now."""
        spread = len(self.runs) / self.events_per_second if self.events_per_second > 0 else 0.0
        return min(self.max_interval, max(self.min_interval, spread))

    def _is_due(self, run: AssignedRun, now: float) -> bool:
        """Whether a run's pending outputs are to be stored with the next append."""
        if not run.pending:
            return False
        if not run.streamed or run.pending[-1].finished:
            return True
        if now - run.pending_since >= self.store_interval:
            return True
        return sum(len(o.new_token_ids) for o in run.pending) >= self.store_tokens

    def _next_due(self, now: float) -> float | None:
        """Seconds until a run's pending outputs are due by time; None when none wait."""
        since = [run.pending_since for run in self.runs.values() if run.pending]
        return max(0.0, min(since) + self.store_interval - now) if since else None

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            now = loop.time()
            due = [r for r, run in self.runs.items() if self._is_due(run, now)]
            if not due and not self._starts_due:
                self._wake.clear()
                until = self._next_due(now)
                if until is None:
                    await self._wake.wait()
                else:
                    await wait_set(self._wake, until)
                continue
            delay = self._last_append + self.interval() - now
            if delay > 0 and not self._urgent.is_set():
                await wait_set(self._urgent, delay)
            self._urgent.clear()
            now = loop.time()
            await self._append_runs([r for r, run in self.runs.items() if self._is_due(run, now)])

    async def flush(self) -> None:
        """Returns once every output handed over so far is stored (or its runs failed)."""
        await self._append_runs([r for r, run in self.runs.items() if run.pending])

    async def _append_runs(self, run_ids: Sequence[str]) -> None:
        """Stores the pending outputs of `run_ids`, and every `prefill` not stored yet."""
        async with self._appending:
            self._starts_due.clear()
            taken: dict[str, list[RequestOutput]] = {}
            for run_id in run_ids:
                run = self.runs.get(run_id)
                if run is not None:
                    taken[run_id], run.pending = run.pending, []
            starts = set(self._starts) & set(self.runs)
            if not taken and not starts:
                return
            self._last_append = asyncio.get_running_loop().time()
            await self._append_retrying(taken, starts)

    async def _append_retrying(
        self, taken: dict[str, list[RequestOutput]], starts: set[str]
    ) -> None:
        while True:
            try:
                await self._append(taken, starts)
                return
            except (OperationalError, InterfaceError) as error:
                # The database is away: keep the outputs and retry.
                log.error("step append failed, retrying", error=repr(error))
                await asyncio.sleep(0.5)
            except Exception as error:
                log.exception("step append failed for good", error=repr(error))
                # The batch spans several tenants' runs and the error's text may hold SQL
                # and their values: it stays in this log.
                await self.fail_runs(set(taken) | starts, APPEND_FAILED)
                return

    def release_all(self) -> list[AssignedRun]:
        """Takes every run off this appender: nothing more is appended for them, and
        `prefill` events not appended yet are dropped."""
        released = list(self.runs.values())
        self.runs.clear()
        self._starts.clear()
        self._starts_due.clear()
        return released

    async def _append(self, taken: dict[str, list[RequestOutput]], starts: set[str]) -> None:
        pending = self._events_by_run(taken, starts)
        stored: Pending = {}
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
        self._stored(stored, taken)

    def _stored(self, stored: Pending, taken: Mapping[str, Sequence[RequestOutput]]) -> None:
        """Moves each run on past the events just stored for it."""
        for run_id, (events, finished) in stored.items():
            self._starts.pop(run_id, None)
            run = self.runs[run_id]
            run.last_seq += len(events)
            run.stored = output_end(run.stored, taken.get(run_id, ()))
            if not run.streamed and any(e.kind != RunState.PREFILL for e in events):
                run.streamed = True
                # Tokens made while its first were being stored: live from now on.
                self._publish(run, run.pending, run.stored)
            if finished:
                self.runs.pop(run_id, None)
                run_finished(run, taken[run_id][-1])
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
        self, taken: Mapping[str, Sequence[RequestOutput]], starts: set[str]
    ) -> Pending:
        pending: Pending = {}
        for run_id in [*starts, *(r for r in taken if r not in starts)]:
            if run_id not in self.runs:
                continue
            start = self._starts.get(run_id)
            outputs = taken.get(run_id, ())
            events = [start] if start is not None else []
            events += step_events(self.runs[run_id], outputs, self.runs[run_id].stored)
            if events:
                pending[run_id] = (events, bool(outputs) and outputs[-1].finished)
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
