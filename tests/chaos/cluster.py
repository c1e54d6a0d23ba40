"""The chaos suite's own PostgreSQL, broker and supervised stack, and how it kills them.

PostgreSQL and the broker are this process's children, so they can be SIGKILLed and
started again: PostgreSQL on its data directory (it recovers from its WAL), the broker
on the same port and empty (the embedded Tansu keeps everything in memory).
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

from services.core import migrate
from services.core.kafka import ensure_topics
from services.stack.infra import (
    KAFKA_BOOTSTRAP_ENV,
    Endpoints,
    LocalInfra,
    create_database,
)
from services.stack.launcher import ServiceProcess, Services, StackConfig
from services.stack.supervisor import Supervisor
from tests.services.core.kafka_tools import Broker, accepts
from tollgate import AdminClient

ADMIN_TOKEN = "chaos-admin-token"
NUM_KV_BLOCKS = 160
TOPIC_PARTITIONS = 4
HEARTBEAT_INTERVAL_S = 1.0
# Two heartbeat intervals: the bound the scheduler is held to for a lost worker.
WORKER_TIMEOUT_S = 2.0
# The simulated engine, inside the worker: steps of a fixed time, whatever the machine.
SIM_ENGINE = {"TOLLGATE_ENGINE_KIND": "sim"}
INTERNAL_TOKEN = "chaos-internal-token"
SERVICE_ENV = {
    "TOLLGATE_HEARTBEAT_INTERVAL": str(HEARTBEAT_INTERVAL_S),
    "TOLLGATE_WORKER_TIMEOUT": str(WORKER_TIMEOUT_S),
    "TOLLGATE_LEDGER_SWEEP_GRACE": "3",
    "TOLLGATE_MAX_TOKENS": "4096",
}
READY_TIMEOUT_S = 60.0


def _sigkill(process: psutil.Process) -> None:
    with contextlib.suppress(psutil.NoSuchProcess):
        process.kill()


class Infra:
    """PostgreSQL (from LocalInfra) and a Broker, both restartable by the chaos.

    Both are started, and started again, from one thread that lives as long as this
    object: a server dies with the thread that started it (its parent-death signal).
    """

    def __init__(self, data_dir: Path) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        self.broker = Broker(data_dir)
        self.local = LocalInfra(data_dir / "pg", topics=())
        self.endpoints: Endpoints | None = None
        self._keeper = ThreadPoolExecutor(1, thread_name_prefix="infra")

    def __enter__(self) -> Endpoints:
        return self._keeper.submit(self._start).result()

    def __exit__(self, *_: object) -> None:
        self._keeper.submit(self._stop).result()
        self._keeper.shutdown()

    def restart_broker_empty(self) -> None:
        self._keeper.submit(self.broker.kill_and_restart).result()

    def restart_postgres(self) -> None:
        self._keeper.submit(self._kill_and_restart_postgres).result()

    def _start(self) -> Endpoints:
        self.broker.start()
        # LocalInfra launches PostgreSQL only: the broker is named.
        previous = os.environ.get(KAFKA_BOOTSTRAP_ENV)
        os.environ[KAFKA_BOOTSTRAP_ENV] = self.broker.bootstrap
        try:
            self.endpoints = self.local.start()
        finally:
            if previous is None:
                del os.environ[KAFKA_BOOTSTRAP_ENV]
            else:
                os.environ[KAFKA_BOOTSTRAP_ENV] = previous
        return self.endpoints

    def _stop(self) -> None:
        self.local.stop()
        self.broker.stop()

    def _kill_and_restart_postgres(self) -> None:
        # The one server LocalInfra launched: the broker is ours.
        [server] = self.local._servers
        postmaster = psutil.Process(server._process.pid)  # type: ignore[union-attr]
        backends = postmaster.children(recursive=True)
        _sigkill(postmaster)
        # A new postmaster refuses to start while old backends still hold the shared memory.
        for backend in backends:
            _sigkill(backend)
        psutil.wait_procs([postmaster, *backends], timeout=10)
        server.stop()  # reaps it
        server.start()
        port = int(server._argv[server._argv.index("-p") + 1])
        server.wait_ready(lambda: accepts(port), READY_TIMEOUT_S)


@dataclass
class Stack:
    services: Services
    supervisor: Supervisor
    admin: AdminClient
    database_url: str

    @property
    def gateways(self) -> list[str]:
        return [p.address for p in self.services.of("admission")]

    @property
    def ledger(self) -> str:
        return self.services.processes["ledger"].address

    def tenant_key(self, name: str) -> str:
        tenant = self.admin.create_tenant(f"{name}-{uuid.uuid4().hex[:6]}")
        return self.admin.create_api_key(tenant.tenant_id).secret

    def processes(self, service: str) -> list[ServiceProcess]:
        return self.services.of(service)


@contextmanager
def supervised_stack(
    endpoints: Endpoints,
    model_dir: Path,
    log_dir: Path,
    replicas: Mapping[str, int] | None = None,
    extra_env: Mapping[str, str] | None = None,
) -> Iterator[Stack]:
    """The four services on a database and topic of their own, restarted when they die."""
    name = f"chaos_{uuid.uuid4().hex[:12]}"
    database_url = create_database(endpoints.database_url, name)
    migrate.upgrade(database_url)
    topic = f"chaos-{uuid.uuid4()}"
    ensure_topics(endpoints.kafka_bootstrap, [topic], TOPIC_PARTITIONS)
    config = StackConfig(
        database_url=database_url,
        kafka_bootstrap=endpoints.kafka_bootstrap,
        model_name="tiny",
        model_dir=model_dir,
        admin_token=ADMIN_TOKEN,
        internal_token=INTERNAL_TOKEN,
        topic=topic,
        num_kv_blocks=NUM_KV_BLOCKS,
        extra_env={
            **SERVICE_ENV,
            "TOLLGATE_TOPIC_PARTITIONS": str(TOPIC_PARTITIONS),
            **(extra_env or {}),
        },
    )
    services = Services(config, log_dir / name, replicas)
    services.start()
    supervisor = Supervisor(services)
    supervisor.start()
    gateways = [p.address for p in services.of("admission")]
    admin = AdminClient(gateways, ADMIN_TOKEN, ledger_address=services.processes["ledger"].address)
    try:
        yield Stack(services, supervisor, admin, database_url)
    finally:
        supervisor.stop()
        services.stop()


def engine_child(worker: ServiceProcess) -> psutil.Process | None:
    """The worker's engine process (multiprocessing's spawned child), if it has one."""
    with contextlib.suppress(psutil.NoSuchProcess):
        for child in psutil.Process(worker.pid).children():
            if any("spawn_main" in part for part in child.cmdline()):
                return child
    return None


def wait_until(condition: Callable[[], bool], timeout: float, interval: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return False
