"""What the scheduler knows about runs: queued, being dispatched, assigned.

Every run id is in at most one of the queue, the dispatching set and the
assignments; `knows` is the dedupe check for intake.  It also remembers the
runs that ended most recently: their `queued` event often reaches the
scheduler through Kafka after their end, and is then dropped without a query.  Only the event loop
touches this state, so a check and the change it guards need no lock as long
as no `await` separates them.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field

from services.core.fleet import WorkerLoad
from services.core.loop import wait_set
from services.scheduler.fair_queue import FairQueue, QueueClass
from services.scheduler.records import Assignment, QueuedRun
from services.scheduler.workers import Worker, WorkerRegistry


@dataclass(frozen=True, slots=True)
class QueueStats:
    num_interactive: int
    num_batch: int
    num_running: int
    num_workers: int
    num_free_blocks: int
    max_run_tokens: dict[str, int]
    # The live workers' KV blocks, and those the queued runs of each class need: what
    # admission's watermarks compare the free blocks with.
    num_total_blocks: int = 0
    num_queued_interactive_blocks: int = 0
    num_queued_batch_blocks: int = 0
    workers: list[WorkerLoad] = field(default_factory=list)


# Ended runs remembered: far more than end between a run's `queued` event and its delivery.
MAX_REMEMBERED_ENDED = 10_000


class SchedulerState:
    def __init__(
        self,
        registry: WorkerRegistry,
        max_skip_age: float = 30.0,
        max_remembered_ended: int = MAX_REMEMBERED_ENDED,
        max_batch_wait: float = 60.0,
    ) -> None:
        self.registry = registry
        self.queue = FairQueue(max_skip_age, max_batch_wait)
        self.queued: dict[str, QueuedRun] = {}
        self.assignments: dict[str, Assignment] = {}
        # Runs taken off the queue whose AssignRun has not settled yet.
        self.dispatching: dict[str, asyncio.Event] = {}
        # Runs the scheduler is ending or re-queueing itself (cancel, lost worker).
        self.settling: set[str] = set()
        # Runs seen to end, oldest first (a dict as an ordered set); an end is final.
        self.ended: dict[str, None] = {}
        self.max_remembered_ended = max_remembered_ended
        # Set whenever dispatch may find something new to do.
        self.wake = asyncio.Event()
        # How many runs each tenant has queued, by model; and each tenant's weight.
        self._waiting: dict[str, Counter[str]] = {}
        self._weights: dict[str, int] = {}

    def knows(self, run_id: str) -> bool:
        return (
            run_id in self.queued
            or run_id in self.assignments
            or run_id in self.dispatching
            or run_id in self.settling
            or run_id in self.ended
        )

    def enqueue(self, run: QueuedRun) -> bool:
        """Queues `run` unless it is known already."""
        if self.knows(run.run_id):
            return False
        self.queued[run.run_id] = run
        self._waiting.setdefault(run.model, Counter())[run.tenant_id] += 1
        self._weights[run.tenant_id] = max(1, run.weight)
        self.queue.push(run.ticket())
        self.wake.set()
        return True

    def is_assigned(self, run_id: str) -> bool:
        return run_id in self.assignments

    def take_back(self, run: QueuedRun) -> None:
        """Ends the assignment of `run` if it is `queued` at a later seq than it was leased
        at: its worker handed it back (its engine died before it streamed)."""
        assignment = self.assignments.get(run.run_id)
        if (
            assignment is not None
            and run.run_id not in self.settling
            and run.last_seq > assignment.last_seq
        ):
            self.forget(run.run_id, assignment.lease_epoch)

    def dequeue(self, run_id: str) -> QueuedRun | None:
        self.queue.remove(run_id)
        return self._unqueue(run_id)

    def _unqueue(self, run_id: str) -> QueuedRun | None:
        run = self.queued.pop(run_id, None)
        if run is not None:
            waiting = self._waiting[run.model]
            waiting[run.tenant_id] -= 1
            if waiting[run.tenant_id] <= 0:
                del waiting[run.tenant_id]
        return run

    def take_next(self, now: float) -> QueuedRun | None:
        """Moves the next run that fits some worker from the queue to dispatching."""
        ticket = self.queue.pick(
            lambda t: self._run_fits(t.run_id), now, lambda t: self._may_ever_fit(t.run_id)
        )
        if ticket is None:
            return None
        run = self._unqueue(ticket.run_id)
        assert run is not None
        self.dispatching[run.run_id] = asyncio.Event()
        return run

    def _run_fits(self, run_id: str) -> bool:
        return self.worker_for(self.queued[run_id]) is not None

    def worker_for(self, run: QueuedRun) -> Worker | None:
        """The worker `run` goes to now: the one with the most free blocks that fits it
        (while other tenants' runs wait for its model, on a worker that cannot suspend
        runs only within its tenant's share), else, for an interactive run, one where
        runs of tenants over their shares would be suspended to make room for it
        (`services/core/shares.py`)."""
        waiting = {
            tenant: self._weights[tenant]
            for tenant in self._waiting.get(run.model, ())
            if tenant != run.tenant_id
        }
        worker = self.registry.choose(
            run.num_kv_blocks, run.model, run.tenant_id, run.weight, waiting
        )
        if worker is None and run.queue_class == QueueClass.INTERACTIVE:
            worker = self.registry.choose_making_room(
                run.num_kv_blocks, run.model, run.tenant_id, run.weight
            )
        return worker

    def _may_ever_fit(self, run_id: str) -> bool:
        run = self.queued[run_id]
        return self.registry.may_ever_fit(run.num_kv_blocks, run.model)

    def settle(self, run_id: str, assignment: Assignment | None = None) -> None:
        """Ends the dispatch of `run_id`: assigned, or (None) dropped."""
        if assignment is not None:
            self.assignments[run_id] = assignment
        event = self.dispatching.pop(run_id, None)
        if event is not None:
            event.set()

    def put_back(self, run: QueuedRun) -> None:
        """Returns a run whose dispatch failed to the queue."""
        self.settle(run.run_id)
        self.enqueue(run)

    async def wait_settled(self, run_id: str, timeout: float) -> None:
        event = self.dispatching.get(run_id)
        if event is not None:
            await wait_set(event, timeout)

    def forget(self, run_id: str, lease_epoch: int | None = None) -> None:
        """Drops a run that ended (or, given `lease_epoch`, only that assignment of it)."""
        assignment = self.assignments.get(run_id)
        if assignment is not None and lease_epoch in (None, assignment.lease_epoch):
            del self.assignments[run_id]
            self.registry.run_ended(run_id)
            self.wake.set()
        if lease_epoch is None:
            self.dequeue(run_id)
            self.ended[run_id] = None
            if len(self.ended) > self.max_remembered_ended:
                del self.ended[next(iter(self.ended))]

    def stats(self) -> QueueStats:
        alive = list(self.registry.alive())
        return QueueStats(
            num_interactive=self.queue.count(QueueClass.INTERACTIVE),
            num_batch=self.queue.count(QueueClass.BATCH),
            num_running=len(self.assignments),
            num_workers=len(alive),
            num_free_blocks=sum(w.num_free_blocks for w in alive),
            max_run_tokens=self.registry.max_run_tokens(),
            num_total_blocks=sum(w.capacity for w in alive),
            num_queued_interactive_blocks=self._queued_blocks(QueueClass.INTERACTIVE),
            num_queued_batch_blocks=self._queued_blocks(QueueClass.BATCH),
            workers=self.worker_loads(),
        )

    def _queued_blocks(self, queue_class: QueueClass) -> int:
        return sum(
            run.num_kv_blocks for run in self.queued.values() if run.queue_class == queue_class
        )

    def worker_loads(self) -> list[WorkerLoad]:
        running = Counter(a.worker_id for a in self.assignments.values())
        return [_load(w, running[w.worker_id]) for w in self.registry.all()]

    def never_fitting(self) -> list[QueuedRun]:
        """Queued runs that live workers serve the model of, none of which could hold them."""
        return [
            run
            for run in self.queued.values()
            if self.registry.serves_any(run.model)
            and not self.registry.may_ever_fit(run.num_kv_blocks, run.model)
        ]


def _load(worker: Worker, num_running: int) -> WorkerLoad:
    return WorkerLoad(
        worker_id=worker.worker_id,
        model=worker.model,
        num_free_blocks=worker.num_free_blocks,
        num_total_blocks=worker.num_total_blocks,
        num_running=num_running,
        alive=worker.alive,
        draining=worker.draining,
        suspect=worker.suspect,
        engine_kind=worker.engine_kind,
        tenants=worker.tenants,
        suspends_runs=worker.suspends_runs,
    )
