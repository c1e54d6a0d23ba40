"""Worker liveness: status polls, lost workers, runs left without a live worker."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import structlog

from services.core.loop import wait_set
from services.scheduler import metrics
from services.scheduler.records import Assignment
from services.scheduler.state import SchedulerState
from services.scheduler.worker_client import WorkerClients
from services.scheduler.workers import Worker

log = structlog.get_logger(__name__)

# Settles an assignment; the text says what became of its worker ("was lost").
Recover = Callable[[Assignment, str], Awaitable[None]]


class LivenessChecker:
    """Polls the GetWorkerStatus of every worker that sent no heartbeat for `interval` (and
    all of them when asked, `poll_now`); a worker unheard of for `timeout` is lost.

    A lost worker's runs go to `recover`; so do runs assigned to a worker that
    has not been alive for `timeout` since they were adopted (a run found in
    the projection after a restart whose owner never shows up), and runs a live
    worker has left out of its reports (status or heartbeat) for `interval`: it
    restarted, or dropped them. The first report that leaves a run out may have
    been composed before the run's AssignRun arrived; one `interval` later the
    worker has had time to report it.
    """

    def __init__(
        self,
        state: SchedulerState,
        clients: WorkerClients,
        recover: Recover,
        *,
        timeout: float = 5.0,
        interval: float = 1.0,
        on_checked: Callable[[float], Awaitable[None]] | None = None,
    ) -> None:
        """`on_checked` is given the time after each check, when the fleet is known anew."""
        self.state = state
        self.clients = clients
        self.recover = recover
        self.timeout = timeout
        self.interval = interval
        self.on_checked = on_checked
        self.poll_now = asyncio.Event()
        # (run_id, lease_epoch) -> when a check first found its worker leaving it out
        self.left_out: dict[tuple[str, int], float] = {}

    async def run(self) -> None:
        asked = True
        while True:
            try:
                await self.check_once(every_worker=asked)
            except Exception:
                log.exception("liveness check failed")
            asked = await wait_set(self.poll_now, self.interval)
            self.poll_now.clear()

    async def check_once(self, *, every_worker: bool = True) -> None:
        """Polls the workers (unless `every_worker`, only those whose last report, status
        or heartbeat, is an `interval` old: the others heartbeat), then settles runs."""
        now = time.monotonic()
        polled = [
            worker
            for worker in self.state.registry.all()
            if every_worker or now - worker.reported_at >= self.interval
        ]
        await asyncio.gather(*(self._poll(w) for w in polled))
        now = time.monotonic()
        lost = set(self.state.registry.expire(now, self.timeout))
        for worker_id in lost:
            metrics.WORKERS_LOST.inc()
            log.warning("worker lost", worker_id=worker_id)
        orphans = [a for a in self.state.assignments.values() if self._orphaned(a, lost, now)]
        dropped = [a for a in self._dropped(now) if a not in orphans]
        for assignment in orphans:
            await self.recover(assignment, "was lost")
        for assignment in dropped:
            log.warning("worker no longer holds the run", run_id=assignment.run_id,
                        worker_id=assignment.worker_id)  # fmt: skip
            await self.recover(assignment, "no longer holds the run")
        if self.on_checked is not None:
            await self.on_checked(now)

    def _dropped(self, now: float) -> list[Assignment]:
        """Assignments their live worker has left out of its reports for `interval`."""
        left_out: dict[tuple[str, int], float] = {}
        for assignment in self.state.assignments.values():
            key = (assignment.run_id, assignment.lease_epoch)
            registry = self.state.registry
            if registry.has_dropped(assignment.worker_id, assignment.run_id, assignment.since):
                left_out[key] = self.left_out.get(key, now)
        self.left_out = left_out
        return [
            assignment
            for assignment in self.state.assignments.values()
            if now - left_out.get((assignment.run_id, assignment.lease_epoch), now) >= self.interval
        ]

    def _orphaned(self, assignment: Assignment, lost: set[str], now: float) -> bool:
        if assignment.worker_id in lost:
            return True
        # Adopted from the projection, or left over from a failed recovery.
        alive = self.state.registry.is_alive(assignment.worker_id)
        return not alive and now - assignment.since > self.timeout

    async def _poll(self, worker: Worker) -> None:
        report = await self.clients.status(worker.address, timeout=min(self.interval, 2.0))
        if report is None:
            return
        was_alive = worker.alive
        self.state.registry.observe(worker.worker_id, report, time.monotonic())
        if not was_alive:
            log.info("worker available", worker_id=worker.worker_id, address=worker.address)
        self.state.wake.set()
