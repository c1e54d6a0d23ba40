"""The scheduler process: its settings, its parts wired together, the server, `main`."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health

from services.core import server as core_server
from services.core.config import CommonSettings, env_float, env_int, env_map
from services.core.db import Database, open_db
from services.core.eventstore import EventStore
from services.core.relay import OutboxRelay
from services.scheduler import metrics
from services.scheduler.cancel import Canceller
from services.scheduler.dispatcher import Dispatcher
from services.scheduler.intake import EventTrigger, Intake
from services.scheduler.liveness import LivenessChecker
from services.scheduler.recovery import Recovery
from services.scheduler.repository import SchedulerRepository
from services.scheduler.servicer import SchedulerServicer
from services.scheduler.state import SchedulerState
from services.scheduler.tracking import AssignmentTracker
from services.scheduler.worker_client import WorkerClients
from services.scheduler.workers import WorkerRegistry
from tollgate.v1 import scheduler_pb2, scheduler_pb2_grpc

log = structlog.get_logger(__name__)

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
    block_size: int = 16
    kafka_session_timeout_ms: int = 10_000

    @classmethod
    def from_env(cls) -> SchedulerSettings:
        return cls(
            common=CommonSettings.from_env(),
            workers=env_map("TOLLGATE_WORKERS"),
            rescan_seconds=env_float("TOLLGATE_SCHEDULER_RESCAN", 2.0),
            worker_timeout=env_float("TOLLGATE_WORKER_TIMEOUT", 5.0),
            heartbeat_interval=env_float("TOLLGATE_HEARTBEAT_INTERVAL", 1.0),
            max_skip_age=env_float("TOLLGATE_SCHEDULER_MAX_SKIP_SECONDS", 30.0),
            block_size=env_int("TOLLGATE_BLOCK_SIZE", 16),
            kafka_session_timeout_ms=env_int("TOLLGATE_KAFKA_SESSION_TIMEOUT_MS", 10_000),
        )


class SchedulerApp:
    """Every part of one scheduler; `background()` are the loops the process runs."""

    def __init__(self, settings: SchedulerSettings, db: Database) -> None:
        self.settings = settings
        registry = WorkerRegistry()
        for worker_id, address in settings.workers.items():
            registry.add_static(worker_id, address)
        self.state = SchedulerState(registry, settings.max_skip_age)
        self.store = EventStore(db)
        self.repository = SchedulerRepository(db, settings.block_size)
        self.clients = WorkerClients()
        self.intake = Intake(self.state, self.repository)
        self.tracker = AssignmentTracker(self.state, self.repository)
        self.recovery = Recovery(self.state, self.store, self.intake.take)
        self.liveness = LivenessChecker(
            self.state,
            self.clients,
            self.recovery.recover,
            timeout=settings.worker_timeout,
            interval=settings.heartbeat_interval,
        )
        self.dispatcher = Dispatcher(
            self.state,
            self.store,
            self.repository,
            self.clients,
            on_no_room=self.liveness.poll_now,
        )
        self.trigger = EventTrigger(
            settings.common.kafka_bootstrap,
            on_queued=self.intake.take,
            on_ended=self.state.forget,
            topic=settings.common.topic,
            session_timeout_ms=settings.kafka_session_timeout_ms,
        )
        self.relay = OutboxRelay.from_settings(db, settings.common)
        self.servicer = SchedulerServicer(
            self.state,
            Canceller(self.state, self.store, self.repository, self.clients),
            heartbeat_interval=settings.heartbeat_interval,
            on_register=self.liveness.poll_now.set,
            on_queued=self.intake.take,
            on_hinted=self.intake.take_hinted,
            block_size=settings.block_size,
        )
        metrics.observe_state(self.state)

    async def rescan(self) -> None:
        """The projection as source of truth: at start and every `rescan_seconds`."""
        while True:
            try:
                await self.intake.scan()
                await self.tracker.sync()
            except Exception:
                log.exception("rescan failed")
            await asyncio.sleep(self.settings.rescan_seconds)

    def background(self) -> list[Coroutine[Any, Any, None]]:
        return [
            self.rescan(),
            self.dispatcher.run(),
            self.liveness.run(),
            self.trigger.run(),
            self.relay.run(),
        ]

    async def close(self) -> None:
        await self.clients.close()


_TRIGGER_WAIT_S = 30.0


def create_server(
    listen: str, app: SchedulerApp
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    def add(server: grpc.aio.Server) -> None:
        scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(app.servicer, server)

    return core_server.create_server(listen, add)


async def _announce(listen: str, port: int, trigger_ready: asyncio.Event) -> None:
    """Prints READY once the Kafka trigger holds its partitions, so that runs queued after
    start-up are dispatched at once rather than at the next rescan. A broker that does not
    answer delays READY by at most `_TRIGGER_WAIT_S`: the rescan keeps the scheduler working."""
    try:
        await asyncio.wait_for(trigger_ready.wait(), _TRIGGER_WAIT_S)
    except TimeoutError:
        log.warning("announcing before the Kafka trigger joined", waited_s=_TRIGGER_WAIT_S)
    core_server.announce(core_server.bound_address(listen, port))
    await asyncio.Event().wait()


async def main(settings: SchedulerSettings) -> None:
    """Runs the scheduler until SIGTERM/SIGINT."""
    db = open_db(settings.common.database_url)
    app = SchedulerApp(settings, db)
    server, port, health_servicer = create_server(settings.common.listen, app)
    metrics_port = core_server.start_metrics(settings.common.metrics_port)
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
            [*app.background(), _announce(settings.common.listen, port, app.trigger.ready)],
        )
    finally:
        await app.close()
        await db.dispose()
