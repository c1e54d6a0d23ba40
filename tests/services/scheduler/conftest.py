import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from services.core.config import CommonSettings
from services.core.db import Database, open_db
from services.core.event_store import EventStore
from services.scheduler.app import SchedulerApp, SchedulerSettings, create_server
from tests.services.scheduler.fakes import FakeWorker
from tollgate.v1 import scheduler_pb2_grpc


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[Database]:
    db = open_db(database_url, pool_size=20)
    yield db
    await db.dispose()


@pytest.fixture
def store(db: Database) -> EventStore:
    return EventStore(db)


@dataclass
class RunningScheduler:
    app: SchedulerApp
    stub: scheduler_pb2_grpc.SchedulerServiceStub
    address: str
    stop: Callable[[], Awaitable[None]]


StartScheduler = Callable[..., Awaitable[RunningScheduler]]


@pytest.fixture
async def start_scheduler(
    db: Database, database_url: str, kafka_bootstrap: str, kafka_topic: str
) -> AsyncIterator[StartScheduler]:
    """Starts an in-process scheduler with fast timings; stopped after the test."""
    cleanups: list[Callable[[], Awaitable[None]]] = []

    async def start(
        workers: Mapping[str, str] | None = None, *, lead: bool = False, **overrides: Any
    ) -> RunningScheduler:
        """`lead`: leads without the lock, as a split brain would."""
        bootstrap = overrides.pop("kafka_bootstrap", kafka_bootstrap)
        common = CommonSettings(database_url, bootstrap, kafka_topic, "127.0.0.1:0")
        options: dict[str, Any] = {
            "rescan_seconds": 0.3,
            "worker_timeout": 1.5,
            "heartbeat_interval": 0.2,
            "kafka_session_timeout_ms": 2000,
            **overrides,
        }
        settings = SchedulerSettings(common=common, workers=dict(workers or {}), **options)
        app = SchedulerApp(settings, db)
        # A consumer group of its own: a group spans topics, so schedulers of other
        # tests (or of a stack on the same broker) would otherwise rebalance with it.
        app.trigger.group_id = f"scheduler-test-{uuid.uuid4().hex[:8]}"
        server, port, _ = create_server(settings.common.listen, app)
        await server.start()
        jobs = [app.lead(), app.relay.run()] if lead else app.background()
        tasks = [asyncio.create_task(job) for job in jobs]
        if not lead:
            # Leading, when it is the only one; following, else.
            await asyncio.wait_for(app.leadership.decided.wait(), 20)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")

        async def stop() -> None:
            if not tasks:
                return
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await channel.close()
            await server.stop(0)
            await app.close()
            tasks.clear()

        cleanups.append(stop)
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        return RunningScheduler(app, stub, f"127.0.0.1:{port}", stop)

    yield start
    for cleanup in reversed(cleanups):
        await cleanup()


@pytest.fixture
async def fake_workers() -> AsyncIterator[Callable[..., Awaitable[FakeWorker]]]:
    started: list[FakeWorker] = []

    async def make(worker_id: str, **kwargs: Any) -> FakeWorker:
        worker = FakeWorker(worker_id, **kwargs)
        await worker.start()
        started.append(worker)
        return worker

    yield make
    for worker in started:
        with contextlib.suppress(Exception):
            await worker.stop()
