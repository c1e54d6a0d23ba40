"""The worker process: `python -m services.worker`."""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
from dataclasses import dataclass

import grpc
import structlog
import torch

from engine.config import KV_DTYPES, QUANTIZATIONS, EngineConfig
from services.core.codec import tenant_shares
from services.core.config import (
    CommonSettings,
    ConfigError,
    env_choice,
    env_float,
    env_int,
    env_map,
    env_str,
)
from services.core.db import open_db
from services.core.event_store import EventStore
from services.core.internal import internal_channel, server_interceptors
from services.core.loop import wait_set
from services.core.metrics import start_metrics
from services.core.server import bound_address, create_server, serve, set_serving
from services.worker.appender import StepAppender
from services.worker.core import WorkerCore, resume_suspended
from services.worker.engines import EngineSettings, engine_starter
from services.worker.live import LivePublisher
from services.worker.runs import AssignedRun
from services.worker.servicer import WorkerServicer
from services.worker.supervisor import EngineSupervisor
from tollgate.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2_grpc

log = structlog.get_logger(__name__)

SERVICES = ("tollgate.v1.WorkerService",)
# The least time between two heartbeats, however many runs end.
MIN_HEARTBEAT_GAP_S = 0.02


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    common: CommonSettings
    worker_id: str
    model_name: str
    model_dir: str
    engine: EngineConfig
    # Which engine serves the tokens: the built-in one, an engine server, or the simulated one.
    backend: EngineSettings
    # Every scheduler replica's host:port (comma-separated): the worker registers with each.
    scheduler_address: str
    drain_seconds: int
    events_per_second: float
    # A run's `streaming` events are stored every so many tokens or seconds.
    store_tokens: int
    store_interval: float
    engine_niceness: int

    @classmethod
    def from_env(cls) -> WorkerSettings:
        models = env_map("TOLLGATE_MODELS")
        if len(models) != 1:
            raise ConfigError("TOLLGATE_MODELS must name exactly one model for a worker (name=dir)")
        [(name, directory)] = models.items()
        adapters = env_map("TOLLGATE_ADAPTERS")
        if name in adapters:
            raise ConfigError(f"TOLLGATE_ADAPTERS: {name!r} is the base model's name")
        return cls(
            common=CommonSettings.from_env("127.0.0.1:0"),
            worker_id=env_str("TOLLGATE_WORKER_ID", "") or default_worker_id(),
            model_name=name,
            model_dir=directory,
            engine=EngineConfig(
                block_size=env_int("TOLLGATE_BLOCK_SIZE", 16),
                num_kv_blocks=env_int("TOLLGATE_KV_BLOCKS", 512),
                max_num_batched_tokens=env_int("TOLLGATE_MAX_BATCHED_TOKENS", 512),
                quantization=_optional(
                    env_choice("TOLLGATE_QUANTIZATION", "none", ("none", *QUANTIZATIONS))
                ),
                kv_dtype=env_choice("TOLLGATE_KV_DTYPE", "auto", KV_DTYPES),
                adapters=tuple(adapters.items()),
                num_threads=engine_threads(
                    env_int("TOLLGATE_ENGINE_THREADS", 0), env_int("TOLLGATE_RESERVED_CORES", 0)
                ),
            ),
            backend=EngineSettings.from_env(),
            scheduler_address=env_str("TOLLGATE_SCHEDULER_ADDRESS", ""),
            drain_seconds=env_int("TOLLGATE_DRAIN_SECONDS", 10),
            events_per_second=env_float("TOLLGATE_STREAM_EVENTS_PER_S", 100.0),
            store_tokens=env_int("TOLLGATE_STORE_EVERY_TOKENS", 16),
            store_interval=env_float("TOLLGATE_STORE_EVERY_S", 5.0),
            engine_niceness=engine_niceness(env_int("TOLLGATE_ENGINE_NICE", ENGINE_NICENESS)),
        )


# The engine's process runs at the services' niceness by default. Below them, each of their
# wake-ups takes a core from the engine's team at once and its step waits at the next
# barrier for that thread: on steady streams the engine lost more than the services gained,
# and beside a busy process it lost most of a core (bench/RESULTS.md). TOLLGATE_ENGINE_NICE
# puts it below them where their latency matters more.
ENGINE_NICENESS = 0


def engine_niceness(configured: int) -> int:
    if not 0 <= configured <= 19:
        raise ConfigError("TOLLGATE_ENGINE_NICE must be between 0 and 19")
    return configured


def engine_threads(configured: int, reserved_cores: int) -> int | None:
    """The engine's threads: `configured` when set, else torch's default less the cores
    reserved for other processes on this machine; None leaves torch's default."""
    if configured < 0 or reserved_cores < 0:
        name = "TOLLGATE_ENGINE_THREADS" if configured < 0 else "TOLLGATE_RESERVED_CORES"
        raise ConfigError(f"{name} must not be negative")
    if configured:
        return configured
    if reserved_cores:
        return max(1, torch.get_num_threads() - reserved_cores)
    return None


def default_worker_id() -> str:
    """Unique per process, so that replicas and restarts never share an id."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


def advertised_address(address: str) -> str:
    """What the scheduler should dial: `address`, or on a wildcard listen address the IP
    this host's name resolves to (a container's own address, so replicas tell apart)."""
    host, _, port = address.rpartition(":")
    if host not in ("0.0.0.0", "[::]", "::"):
        return address
    return f"{socket.gethostbyname(socket.gethostname())}:{port}"


def _optional(choice: str) -> str | None:
    return None if choice == "none" else choice


async def heartbeat(
    core: WorkerCore,
    scheduler_address: str,
    address: str,
    internal_token: str = "",
    runs_ended: asyncio.Event | None = None,
) -> None:
    """Registers with the scheduler and keeps telling it how much room is left: every
    interval, and soon after `runs_ended` is set, so that the blocks of a run that just
    ended go to the next queued run at once instead of at the next interval."""
    channel = internal_channel(scheduler_address, internal_token)
    stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
    interval, registered = 1.0, False
    while True:
        try:
            if not registered:
                reply = await stub.RegisterWorker(
                    scheduler_pb2.RegisterWorkerRequest(
                        worker_id=core.worker_id,
                        address=address,
                        model=core.model,
                        boot_id=core.boot_id,
                        adapters=core.adapters,
                        engine_kind=core.engine_kind,
                    ),
                    timeout=2.0,
                )
                interval, registered = reply.heartbeat_interval_seconds or 1.0, True
            status = core.status()
            beat = await stub.Heartbeat(
                scheduler_pb2.HeartbeatRequest(
                    worker_id=core.worker_id,
                    num_free_blocks=status.num_free_blocks,
                    running_run_ids=status.running_run_ids,
                    draining=status.draining,
                    boot_id=status.boot_id,
                    tenants=tenant_shares(status.tenants),
                    suspends_runs=status.suspends_runs,
                ),
                timeout=2.0,
            )
            registered = beat.known
        except grpc.aio.AioRpcError as error:
            log.warning(
                "heartbeat failed",
                scheduler=scheduler_address,
                code=error.code().name,
                details=error.details(),
            )
            registered = False
        await asyncio.sleep(MIN_HEARTBEAT_GAP_S)  # runs ending together share one beat
        if runs_ended is None:
            await asyncio.sleep(interval - MIN_HEARTBEAT_GAP_S)
        else:
            await wait_set(runs_ended, interval - MIN_HEARTBEAT_GAP_S)
            runs_ended.clear()


async def drain(core: WorkerCore, seconds: int) -> None:
    """Refuses new runs and gives running ones `seconds` to finish."""
    core.draining = True
    for _ in range(seconds * 10):
        if not core.runs:
            return
        await asyncio.sleep(0.1)
    log.warning("stopping with runs still in flight", running_run_ids=sorted(core.runs))


async def main(settings: WorkerSettings) -> None:
    db = open_db(settings.common.database_url, pool_size=settings.common.db_pool_size)
    store = EventStore(db)
    runs: dict[str, AssignedRun] = {}
    live = LivePublisher(settings.common.database_url)
    appender = StepAppender(
        store,
        runs,
        lambda run_id: core.engine.abort(run_id),
        publish=live.publish,
        events_per_second=settings.events_per_second,
        store_tokens=settings.store_tokens,
        store_interval=settings.store_interval,
    )

    start_engine = engine_starter(
        settings.backend,
        settings.model_name,
        settings.model_dir,
        settings.engine,
        appender.on_step,
        niceness=settings.engine_niceness,
    )
    engine = await start_engine()
    core = WorkerCore(
        settings.worker_id,
        settings.model_name,
        engine,
        store,
        appender.start,
        runs,
        drop_run=appender.drop,
        adapters=[name for name, _ in settings.engine.adapters],
        engine_kind=settings.backend.kind,
    )

    def add_servicers(server: grpc.aio.Server) -> None:
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(WorkerServicer(core), server)

    server, port, health = create_server(
        settings.common.listen,
        add_servicers,
        interceptors=server_interceptors(settings.common.internal_token, SERVICES),
    )
    address = bound_address(settings.common.listen, port)
    supervisor = EngineSupervisor(
        core,
        appender,
        store,
        engine,
        start_engine,
        on_ready=lambda ready: set_serving(health, SERVICES, ready),
    )
    # No outbox relay here: the other services run one, and this process's event loop
    # should stay quick to append each step.
    background = [
        appender.run(),
        live.run(),
        supervisor.run(),
        resume_suspended(core, appender.watch_ended()),
    ]
    if settings.scheduler_address:
        # What the scheduler should dial, when it differs from the listen address (0.0.0.0, NAT).
        advertised = env_str("TOLLGATE_WORKER_ADVERTISE", "") or advertised_address(address)
        background.extend(
            heartbeat(
                core,
                scheduler.strip(),
                advertised,
                settings.common.internal_token,
                appender.watch_ended(),
            )
            for scheduler in settings.scheduler_address.split(",")
            if scheduler.strip()
        )
    metrics_port, metrics_tasks = start_metrics(settings.common.metrics, "worker", db)
    background.extend(metrics_tasks)
    log.info(
        "serving",
        address=address,
        metrics_port=metrics_port,
        model=settings.model_name,
        adapters=core.adapters,
        engine=settings.backend.kind,
    )
    try:
        await serve(
            server,
            health,
            SERVICES,
            background,
            grace=float(settings.drain_seconds),
            before_stop=lambda: drain(core, settings.drain_seconds),
            address=address,
        )
    finally:
        await supervisor.engine.shutdown()
        await db.dispose()
