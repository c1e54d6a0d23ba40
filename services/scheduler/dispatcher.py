"""The dispatch loop: next run that fits, a worker with room, lease, AssignRun."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import structlog
from opentelemetry import trace
from sqlalchemy.exc import InterfaceError, OperationalError

from services.core.event_store import EventStore
from services.core.runs import EventStoreError, NewEvent, RunState
from services.core.telemetry import bound_log_context, context_from_traceparent, get_tracer
from services.scheduler import metrics
from services.scheduler.records import Assignment, QueuedRun
from services.scheduler.scheduler_store import SchedulerStore
from services.scheduler.state import SchedulerState
from services.scheduler.worker_client import AssignOutcome, Grant, WorkerClients
from services.scheduler.workers import Worker

log = structlog.get_logger(__name__)

MAX_REJECTIONS = 3
# Assignments in flight at once: each waits on a lease transaction and a worker RPC.
MAX_IN_FLIGHT = 8
REJECTED = "REJECTED"
# After a dispatch fails on the database, none is tried for a while, doubling each time:
# a database that is away is not asked again at once for every queued run.
MIN_BACKOFF_S = 0.1
MAX_BACKOFF_S = 5.0
# How long the dispatcher waits with nothing queued before it looks anyway.
EMPTY_QUEUE_WAIT_S = 5.0


class Dispatcher:
    def __init__(
        self,
        state: SchedulerState,
        store: EventStore,
        scheduler_store: SchedulerStore,
        clients: WorkerClients,
        *,
        idle_interval: float = 0.5,
        on_no_room: asyncio.Event | None = None,
    ) -> None:
        self.state = state
        self.store = store
        self.scheduler_store = scheduler_store
        self.clients = clients
        self.idle_interval = idle_interval
        # Set when a worker refused for lack of room, so its status is refreshed.
        self.on_no_room = on_no_room
        # run_id -> how often workers refused it outright
        self.rejections: dict[str, int] = {}
        self.backoff = 0.0  # seconds; 0 while dispatches succeed
        self._paused_until = 0.0  # loop time

    async def run(self) -> None:
        """Dispatches until cancelled, several runs at once; sleeps while nothing fits."""
        in_flight: set[asyncio.Task[None]] = set()
        try:
            while True:
                await self._wait_out_backoff()
                self.state.wake.clear()
                while len(in_flight) < MAX_IN_FLIGHT and (claim := self._claim()) is not None:
                    task = asyncio.create_task(self._dispatch_logged(*claim))
                    in_flight.add(task)
                    task.add_done_callback(in_flight.discard)
                woken = asyncio.ensure_future(self.state.wake.wait())
                # Queued runs age (batch runs are promoted in time); an empty queue only
                # changes with a `wake`.
                busy = self.state.queued or in_flight
                await asyncio.wait(
                    {woken, *in_flight},
                    timeout=self.idle_interval if busy else EMPTY_QUEUE_WAIT_S,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                woken.cancel()
        finally:
            for task in in_flight:
                task.cancel()

    def _claim(self) -> tuple[QueuedRun, Worker] | None:
        """The next run that fits and its worker, with the worker's blocks held for it."""
        run = self.state.take_next(time.time())
        if run is None:
            return None
        worker = self.state.worker_for(run)
        if worker is None:  # cannot happen right after take_next; be safe anyway
            self.state.put_back(run)
            return None
        # Held while the assignment is in flight, so parallel dispatches do not overbook.
        self.state.registry.reserve(worker.worker_id, run.holding(time.monotonic()))
        return run, worker

    async def _wait_out_backoff(self) -> None:
        delay = self._paused_until - asyncio.get_running_loop().time()
        if delay > 0:
            await asyncio.sleep(delay)

    async def _dispatch_logged(self, run: QueuedRun, worker: Worker) -> None:
        try:
            await self.dispatch(run, worker)
        except (OperationalError, InterfaceError) as error:  # the run went back
            self._back_off()
            log.warning("database away; dispatch paused", error=repr(error), pause_s=self.backoff)
        except Exception:
            self._back_off()
            log.exception("dispatch failed", run_id=run.run_id, pause_s=self.backoff)
        else:
            self.backoff = 0.0

    def _back_off(self) -> None:
        self.backoff = min(MAX_BACKOFF_S, max(MIN_BACKOFF_S, 2 * self.backoff))
        self._paused_until = asyncio.get_running_loop().time() + self.backoff

    async def dispatch_one(self) -> bool:
        """Hands one run to a worker; False when no queued run fits any worker now."""
        claim = self._claim()
        if claim is None:
            return False
        await self.dispatch(*claim)
        return True

    async def dispatch(self, run: QueuedRun, worker: Worker) -> None:
        """Leases `run` and assigns it to `worker`; on any failure it goes back in the queue."""
        span = get_tracer().start_as_current_span(
            "tollgate.scheduler.dispatch",
            context=context_from_traceparent(run.traceparent),
            attributes={
                "tollgate.run_id": run.run_id,
                "tollgate.tenant_id": run.tenant_id,
                "gen_ai.request.model": run.model,
                "tollgate.seq": run.last_seq,
            },
        )
        outcome: AssignOutcome | None = None
        try:
            with span, bound_log_context(run_id=run.run_id, tenant_id=run.tenant_id):
                outcome = await self._lease_and_assign(run, worker.worker_id, worker.address)
        except BaseException:
            self.state.put_back(run)
            raise
        finally:
            if outcome != AssignOutcome.ASSIGNED:
                self.state.registry.release(worker.worker_id, run.run_id)
            if outcome == AssignOutcome.NO_ROOM:
                # After the release, which would otherwise undo it: the worker has less
                # room than this run until it reports again.
                self.state.registry.mark_full(worker.worker_id, run.num_kv_blocks)

    async def _lease_and_assign(
        self, run: QueuedRun, worker_id: str, address: str
    ) -> AssignOutcome | None:
        """The worker's answer, or None when the run was no longer queued."""
        leased = await self.scheduler_store.lease_if_queued(
            run.run_id, worker_id, run.last_seq, run.lease_epoch
        )
        if leased is None:
            log.info("run no longer queued, or leased since; dropped")
            self.rejections.pop(run.run_id, None)
            self.state.settle(run.run_id)
            return None
        grant = Grant(lease_epoch=leased[0], last_seq=leased[1])
        # Should it come back to the queue, it is leased again from this epoch.
        run = dataclasses.replace(run, lease_epoch=grant.lease_epoch)
        result = await self.clients.assign(address, run, grant)
        metrics.DISPATCHES.labels(outcome=str(result.outcome)).inc()
        if result.outcome == AssignOutcome.ASSIGNED:
            self._assigned(run, worker_id, grant)
        elif result.outcome == AssignOutcome.REFUSED:
            await self._rejected(run, worker_id, grant, result.detail)
        else:
            self._not_now(run, worker_id, result.outcome)
        return result.outcome

    def _assigned(self, run: QueuedRun, worker_id: str, grant: Grant) -> None:
        self.rejections.pop(run.run_id, None)
        assignment = Assignment(
            run_id=run.run_id,
            tenant_id=run.tenant_id,
            worker_id=worker_id,
            lease_epoch=grant.lease_epoch,
            since=time.monotonic(),
            last_seq=grant.last_seq,
        )
        self.state.settle(run.run_id, assignment)
        waited = metrics.observe_queue_time(run)
        trace.get_current_span().set_attribute("tollgate.queue_time_seconds", waited)
        log.info(
            "run assigned",
            worker_id=worker_id,
            lease_epoch=grant.lease_epoch,
            queued_s=round(waited, 3),
        )

    def _not_now(self, run: QueuedRun, worker_id: str, outcome: AssignOutcome) -> None:
        if outcome == AssignOutcome.NO_ROOM:
            if self.on_no_room is not None:
                self.on_no_room.set()
        else:
            self.state.registry.mark_suspect(worker_id)
        # last_seq is unchanged: the lease moved, no event was appended.
        self.state.put_back(run)

    async def _rejected(self, run: QueuedRun, worker_id: str, grant: Grant, detail: str) -> None:
        """A worker refused the run itself; after MAX_REJECTIONS it ends `failed`."""
        # The worker is not asked again until it is heard from, so this cannot spin.
        self.state.registry.mark_suspect(worker_id)
        count = self.rejections[run.run_id] = self.rejections.get(run.run_id, 0) + 1
        if count < MAX_REJECTIONS:
            self.state.put_back(run)
            return
        del self.rejections[run.run_id]
        failed = NewEvent(
            RunState.FAILED,
            {
                "code": REJECTED,
                "message": f"no worker accepted the run: {detail}",
                "usage": {"prompt_tokens": len(run.prompt_token_ids)},
            },
        )
        try:
            await self.store.append(
                run.run_id, grant.last_seq, [failed], lease_epoch=grant.lease_epoch
            )
        except EventStoreError:
            self.state.put_back(run)  # it moved on meanwhile; the next round decides again
            return
        log.warning("run failed: rejected by workers", detail=detail)
        self.state.settle(run.run_id)
