"""The scheduler process: its settings, its parts wired together, the server, `main`.

Schedulers run as replicas; one leads (`services/core/leadership.py`): only the leader
takes runs in, dispatches, watches workers and recovers their runs.  Followers keep the
worker registry (every worker registers with and heartbeats to every scheduler), so a
new leader knows the fleet at once, and answer CancelRun from the projection; they drop
admission's hints, which the leader's Kafka trigger and rescan make up for.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health

from services.core import server as core_server
from services.core.config import CommonSettings, env_float, env_int, env_map
from services.core.db import Database, open_db
from services.core.event_store import EventStore
from services.core.idle import IdleFetch
from services.core.internal import server_interceptors
from services.core.leadership import Leadership
from services.core.loop import within
from services.core.metrics import start_metrics
from services.core.relay import OutboxRelay
from services.scheduler import metrics
from services.scheduler.cancel import Canceller
from services.scheduler.dispatcher import Dispatcher
from services.scheduler.intake import EventTrigger, Intake
from services.scheduler.liveness import LivenessChecker
from services.scheduler.records import QueuedRun
from services.scheduler.recovery import Recovery
from services.scheduler.scheduler_store import SchedulerStore
from services.scheduler.servicer import SchedulerServicer
from services.scheduler.state import SchedulerState
from services.scheduler.tracking import AssignmentTracker
from services.scheduler.unfit import UnfitRuns
from services.scheduler.worker_client import WorkerClients
from services.scheduler.workers import WorkerRegistry
from tollgate.v1 import scheduler_pb2, scheduler_pb2_grpc

log = structlog.get_logger(__name__)

# Arbitrary constant naming the scheduler's advisory lock.
SCHEDULER_LOCK_KEY = 0x7363686C  # "schl"
# How often the projection is scanned while nothing is appended (the trigger sleeps).
QUIET_RESCAN_S = 30.0

SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"].full_name


@dataclass(frozen=True, slots=True)
class SchedulerSettings:
    common: CommonSettings
    # worker_id -> host:port of workers known from configuration
    workers: Mapping[str, str] = field(default_factory=dict)
    rescan_seconds: float = 2.0
    worker_timeout: float = 5.0
    heartbeat_interval: float = 1.0
    max_skip_age: float = 30.0
    max_batch_wait: float = 60.0
    # How long a queued run may find no live worker able to hold it before it fails.
    unfit_grace: float = 30.0
    block_size: int = 16
    kafka_session_timeout_ms: int = 10_000
    # How often a follower tries to take over, and a leader checks it still leads.
    takeover_interval: float = 0.5

    @classmethod
    def from_env(cls) -> SchedulerSettings:
        return cls(
            common=CommonSettings.from_env(),
            workers=env_map("TOLLGATE_WORKERS"),
            rescan_seconds=env_float("TOLLGATE_SCHEDULER_RESCAN", 2.0),
            worker_timeout=env_float("TOLLGATE_WORKER_TIMEOUT", 5.0),
            heartbeat_interval=env_float("TOLLGATE_HEARTBEAT_INTERVAL", 1.0),
            max_skip_age=env_float("TOLLGATE_SCHEDULER_MAX_SKIP_SECONDS", 30.0),
            max_batch_wait=env_float("TOLLGATE_SCHEDULER_MAX_BATCH_WAIT", 60.0),
            unfit_grace=env_float("TOLLGATE_SCHEDULER_UNFIT_GRACE", 30.0),
            block_size=env_int("TOLLGATE_BLOCK_SIZE", 16),
            kafka_session_timeout_ms=env_int("TOLLGATE_KAFKA_SESSION_TIMEOUT_MS", 10_000),
            takeover_interval=env_float("TOLLGATE_SCHEDULER_TAKEOVER_INTERVAL", 0.5),
        )


class SchedulerApp:
    """Every part of one scheduler; `background()` are the loops the process runs."""

    def __init__(self, settings: SchedulerSettings, db: Database) -> None:
        self.settings = settings
        registry = WorkerRegistry(settings.worker_timeout)
        for worker_id, address in settings.workers.items():
            registry.add_static(worker_id, address)
        self.state = SchedulerState(
            registry, settings.max_skip_age, max_batch_wait=settings.max_batch_wait
        )
        self.store = EventStore(db)
        self.scheduler_store = SchedulerStore(db, settings.block_size)
        self.clients = WorkerClients(internal_token=settings.common.internal_token)
        self.intake = Intake(self.state, self.scheduler_store)
        self.tracker = AssignmentTracker(self.state, self.scheduler_store)
        self.recovery = Recovery(self.state, self.store, self.intake.take)
        self.unfit = UnfitRuns(self.state, self.store, settings.unfit_grace)
        self.liveness = LivenessChecker(
            self.state,
            self.clients,
            self.recovery.recover,
            timeout=settings.worker_timeout,
            interval=settings.heartbeat_interval,
            on_checked=self.unfit.check,
        )
        self.dispatcher = Dispatcher(
            self.state,
            self.store,
            self.scheduler_store,
            self.clients,
            on_no_room=self.liveness.poll_now,
        )
        self.idle = IdleFetch(db)
        self.trigger = EventTrigger(
            settings.common.kafka_bootstrap,
            on_queued=self.intake.take_events,
            on_ended=self.state.forget,
            topic=settings.common.topic,
            session_timeout_ms=settings.kafka_session_timeout_ms,
            idle=self.idle,
        )
        self.relay = OutboxRelay.from_settings(db, settings.common)
        self.leadership = Leadership(
            db,
            SCHEDULER_LOCK_KEY,
            name="scheduler",
            takeover_interval=settings.takeover_interval,
            check_interval=settings.takeover_interval,
        )
        self.servicer = SchedulerServicer(
            self.state,
            Canceller(self.state, self.store, self.scheduler_store, self.clients),
            heartbeat_interval=settings.heartbeat_interval,
            on_register=self.liveness.poll_now.set,
            on_queued=self._take_queued,
            on_hinted=self._take_hinted,
            block_size=settings.block_size,
        )
        metrics.observe_state(self.state)

    async def rescan(self) -> None:
        """The projection as source of truth: every `rescan_seconds`; while nothing is
        appended (the trigger sleeps through a quiet spell), once in the spell and then
        every `QUIET_RESCAN_S`."""
        scanned_spell: int | None = None
        scanned_at = 0.0
        while True:
            await asyncio.sleep(self.settings.rescan_seconds)
            spell = self.idle.quiet_spell
            scanned = spell is not None and spell == scanned_spell
            if scanned and time.monotonic() - scanned_at < QUIET_RESCAN_S:
                continue
            try:
                started = time.monotonic()
                await self.refresh()
                scanned_spell, scanned_at = spell, started
            except Exception:
                log.exception("rescan failed")

    async def refresh(self) -> None:
        await self.intake.scan()
        await self.tracker.sync()

    async def lead(self, _: object = None) -> None:
        """One term as leader: from the projection as it is now, until cancelled."""
        try:
            # Before anything acts on them: what a former term left may be stale.
            await self.refresh()
            await asyncio.gather(
                self.rescan(), self.dispatcher.run(), self.liveness.run(), self.trigger.run()
            )
        finally:
            self._stand_down()

    def _stand_down(self) -> None:
        """Forgets the term's queue and assignments; the next leader reads them again."""
        for run_id, assignment in list(self.state.assignments.items()):
            self.state.forget(run_id, assignment.lease_epoch)
        for run_id in list(self.state.queued):
            self.state.dequeue(run_id)
        log.info("scheduler no longer leading")

    async def _take_queued(self, run_ids: Collection[str]) -> int:
        return await self.intake.take(run_ids) if self.leadership.is_leader.is_set() else 0

    def _take_hinted(self, runs: Collection[QueuedRun]) -> int:
        return self.intake.take_hinted(runs) if self.leadership.is_leader.is_set() else 0

    def background(self) -> list[Coroutine[Any, Any, None]]:
        return [self.leadership.run(self.lead), self.relay.run()]

    async def close(self) -> None:
        await self.clients.close()


_TRIGGER_WAIT_S = 30.0


def create_server(
    listen: str, app: SchedulerApp
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    def add(server: grpc.aio.Server) -> None:
        scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(app.servicer, server)

    services = [scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"].full_name]
    interceptors = server_interceptors(app.settings.common.internal_token, services)
    return core_server.create_server(listen, add, interceptors=interceptors)


async def _announce(listen: str, port: int, app: SchedulerApp) -> None:
    """Prints READY once this scheduler follows, or leads and its Kafka trigger holds its
    partitions, so that runs queued after start-up are dispatched at once rather than at
    the next rescan. A broker that does not answer delays READY by at most
    `_TRIGGER_WAIT_S`: the rescan keeps the scheduler working."""
    await app.leadership.decided.wait()
    try:
        if app.leadership.is_leader.is_set():
            await within(app.trigger.ready.wait(), _TRIGGER_WAIT_S)
    except TimeoutError:
        log.warning("announcing before the Kafka trigger joined", waited_s=_TRIGGER_WAIT_S)
    core_server.announce(core_server.bound_address(listen, port))
    await asyncio.Event().wait()


async def main(settings: SchedulerSettings) -> None:
    """Runs the scheduler until SIGTERM/SIGINT."""
    db = open_db(settings.common.database_url, pool_size=settings.common.db_pool_size)
    app = SchedulerApp(settings, db)
    server, port, health_servicer = create_server(settings.common.listen, app)
    metrics_port, metrics_tasks = start_metrics(settings.common.metrics, "scheduler", db)
    log.info(
        "scheduler starting",
        port=port,
        metrics_port=metrics_port,
        num_static_workers=len(settings.workers),
    )
    try:
        await core_server.serve(
            server,
            health_servicer,
            [SERVICE_NAME],
            [*app.background(), *metrics_tasks, _announce(settings.common.listen, port, app)],
        )
    finally:
        await app.close()
        await db.dispose()
