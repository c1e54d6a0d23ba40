"""Starts the four service processes the way `tollgate up` runs them.

Each service is `python -m services.<name>` configured by TOLLGATE_* variables;
it listens on a free port and prints `READY <host:port>` once it serves.
Logs go to `<data_dir>/logs/<service>.log`.
"""

from __future__ import annotations

import contextlib
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from services.core.parent import die_with_parent_env
from services.stack.health_check import is_serving
from services.stack.infra import free_port
from services.stack.server_process import InfraError, stop_process

log = structlog.get_logger(__name__)

READY_TIMEOUT_S = 120.0
# How often a wait for READY looks at a stop request and the health check.
READY_POLL_S = 0.2
STOP_TIMEOUT_S = 15.0


# The worker shares the machine with the other services. With 4 cores or more, one is
# left to them, or they queue behind the engine's matrix multiplies (each hop of a run's
# way to its first token waits for a core). With fewer, the engine needs every core: a
# core left to the services is then a large share of the machine taken from the engine,
# more than the services gain (bench/RESULTS.md). Either variable set by the caller wins.
THREAD_VARIABLES = ("TOLLGATE_ENGINE_THREADS", "TOLLGATE_RESERVED_CORES")
COLOCATED_RESERVED_CORES = "1"
RESERVE_FROM_CORES = 4


def physical_cores(
    cpus: Iterable[int] | None = None, sysfs: Path = Path("/sys/devices/system/cpu")
) -> int:
    """The cores under `cpus` (default: those this process may run on), hyperthreads of
    one core counted once."""
    cores = set()
    for cpu in os.sched_getaffinity(0) if cpus is None else cpus:
        cores.add(_core_of(sysfs / f"cpu{cpu}" / "topology", cpu))
    return len(cores)


def _core_of(topology: Path, cpu: int) -> str:
    """The list of CPUs sharing `cpu`'s core (`thread_siblings_list` before Linux 5.3)."""
    for name in ("core_cpus_list", "thread_siblings_list"):
        with contextlib.suppress(OSError):
            return (topology / name).read_text().strip()
    return str(cpu)


@dataclass(frozen=True, slots=True)
class StackConfig:
    database_url: str
    kafka_bootstrap: str
    model_name: str
    model_dir: Path
    admin_token: str
    # LoRA adapters of the model, each served as a model of its own name.
    adapters: Mapping[str, Path] = field(default_factory=dict)
    topic: str = "tollgate.run-events.v1"
    num_kv_blocks: int = 512
    disconnect_grace: float = 30.0
    gateway_listen: str = "127.0.0.1:0"
    http_listen: str = "127.0.0.1:0"
    # What every internal call carries (TOLLGATE_INTERNAL_TOKEN); new for each stack.
    internal_token: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    extra_env: Mapping[str, str] = field(default_factory=dict)
    # The workers' TOLLGATE_ENGINE_* variables (which engine serves the tokens); none: the
    # built-in engine.
    engine_env: Mapping[str, str] = field(default_factory=dict)
    # PEM files of the public ports' TLS certificate and key; none: plaintext.
    tls_cert: Path | None = None
    tls_key: Path | None = None


# Only the services with a public port take the admin token (admin calls, ledger reports
# of every tenant) and the TLS key; the others are never given them, whatever this
# process's own environment holds.
PUBLIC_SERVICES = ("admission", "ledger")
PUBLIC_ONLY_VARIABLES = ("TOLLGATE_ADMIN_TOKEN", "TOLLGATE_TLS_CERT", "TOLLGATE_TLS_KEY")


class Stopped(Exception):
    """A stop request ended a wait for a process to be ready."""


class ServiceProcess:
    """One service child process; it dies with the process that started it."""

    def __init__(
        self,
        name: str,
        module: str,
        env: Mapping[str, str],
        log_path: Path,
        service: str | None = None,
    ) -> None:
        self.name = name  # this process: the service's name, `-2`, `-3` … for more replicas
        self.service = service or name
        self.module = module
        self.env = dict(env)
        self.log_path = log_path
        self.address = ""
        self.endpoints: dict[str, str] = {}
        listen = self.env.get("TOLLGATE_METRICS_LISTEN", "")
        self.metrics_port = int(listen.rpartition(":")[2]) if listen else -1
        self.process: subprocess.Popen[str] | None = None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self) -> None:
        log.info(f"starting {self.name}", log_path=str(self.log_path))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as err:
            # No preexec_fn: the service ties itself to this process (`follow_parent`).
            self.process = subprocess.Popen(
                [sys.executable, "-m", self.module],
                env=self.child_env(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                process_group=0,
            )

    def child_env(self) -> dict[str, str]:
        """The process's environment: this one's, less what only public services take
        unless `env` gives it, with `env` over it."""
        inherited = {k: v for k, v in os.environ.items() if k not in PUBLIC_ONLY_VARIABLES}
        # Each process's connections name it in pg_stat_activity and the server's log.
        named = {"PGAPPNAME": f"tollgate-{self.name}"}
        return {**named, **inherited, **self.env, **die_with_parent_env(signal.SIGTERM)}

    def wait_ready(
        self,
        timeout: float = READY_TIMEOUT_S,
        stopping: threading.Event | None = None,
        serving: Callable[[], bool] | None = None,
    ) -> str:
        """Waits for the READY line and returns the address it names; the other endpoints
        it names (`http=URL`) go to `endpoints`. Ends sooner once `serving()` holds (the
        address and endpoints then stay as they were); raises Stopped once `stopping` is
        set."""
        assert self.process is not None
        lines = self._stdout_lines()
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = lines.get(timeout=READY_POLL_S)
            except queue.Empty:
                line = ""
            if line is not None and line.startswith("READY "):
                self.address, *endpoints = line.split()[1:]
                self.endpoints = dict(e.partition("=")[::2] for e in endpoints)
                return self._ready()
            if stopping is not None and stopping.is_set():
                raise Stopped(f"{self.name} was not ready when the stop came")
            if line is None:  # its output ended: it exited, or is about to
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(5)
                raise self._not_ready(timeout)
            if serving is not None and serving():
                return self._ready()
            if time.monotonic() > deadline:
                raise self._not_ready(timeout)

    def _stdout_lines(self) -> queue.Queue[str | None]:
        """The lines the process prints, read in a thread of their own; None at the end."""
        assert self.process is not None and self.process.stdout is not None
        lines: queue.Queue[str | None] = queue.Queue()
        stdout = self.process.stdout

        def read_lines() -> None:
            for line in stdout:
                lines.put(line)
            lines.put(None)  # its output ended: the process is gone, so is the wait

        threading.Thread(target=read_lines, daemon=True).start()
        return lines

    def _ready(self) -> str:
        log.info(f"{self.name} ready", address=self.address, pid=self.pid, **self.endpoints)
        return self.address

    def _not_ready(self, timeout: float) -> InfraError:
        assert self.process is not None
        status = self.process.poll()
        state = (
            f"exited with status {status}"
            if status is not None
            else f"not ready after {timeout:.0f}s"
        )
        return InfraError(f"{self.name} {state}; see {self.log_path}\n{self.log_tail()}")

    def log_tail(self, num_lines: int = 15) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])

    def exit_status(self) -> int | None:
        """None while it runs (or was stopped), else how it exited."""
        return None if self.process is None else self.process.poll()

    def restart(self, stopping: threading.Event | None = None) -> str:
        """Starts it again, on the addresses it had, and waits until it serves there: its
        READY line or its health check, whichever comes first. (A scheduler prints READY
        once its Kafka consumer holds partitions; after a crash that waits until the
        broker gives up on the dead process's consumer, long after it serves.) Raises
        Stopped once `stopping` is set."""
        if self.address:
            self.env["TOLLGATE_LISTEN"] = self.address
        if "http" in self.endpoints:
            self.env["TOLLGATE_HTTP_LISTEN"] = self.endpoints["http"].partition("://")[2]
        self.start()
        return self.wait_ready(stopping=stopping, serving=self._health_check())

    def _health_check(self) -> Callable[[], bool] | None:
        """The health check at its address; none with TLS (plaintext only), where READY
        comes as soon as it serves."""
        if not self.address or "TOLLGATE_TLS_CERT" in self.env:
            return None
        address = self.address
        return lambda: is_serving(address)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        process, self.process = self.process, None
        stop_process(self.name, process, signal.SIGTERM, timeout)


SERVICE_NAMES = ("admission", "scheduler", "worker", "ledger")


def parse_replicas(text: str) -> dict[str, int]:
    """`admission=2,worker=3` as a count per service; the others stay at 1."""
    replicas = dict.fromkeys(SERVICE_NAMES, 1)
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, count = item.partition("=")
        if name not in replicas or not count.isdigit() or int(count) < 1:
            raise ValueError(f"{item!r}: expected NAME=N with N >= 1, NAME one of {SERVICE_NAMES}")
        replicas[name] = int(count)
    return replicas


class Services:
    """ledger → scheduler → worker → admission, each as many times as `replicas` says,
    started in dependency order. `processes` names each process (see ServiceProcess)."""

    def __init__(
        self, config: StackConfig, log_dir: Path, replicas: Mapping[str, int] | None = None
    ) -> None:
        self.config = config
        self.log_dir = log_dir
        self.replicas = {**dict.fromkeys(SERVICE_NAMES, 1), **(replicas or {})}
        self.processes: dict[str, ServiceProcess] = {}
        self._stopping: threading.Event | None = None

    def of(self, service: str) -> list[ServiceProcess]:
        """The processes of `service`, first started first."""
        return [p for p in self.processes.values() if p.service == service]

    def common_env(self) -> dict[str, str]:
        return {
            "TOLLGATE_DATABASE_URL": self.config.database_url,
            "TOLLGATE_KAFKA_BOOTSTRAP": self.config.kafka_bootstrap,
            "TOLLGATE_TOPIC": self.config.topic,
            "TOLLGATE_LISTEN": "127.0.0.1:0",
            "TOLLGATE_INTERNAL_TOKEN": self.config.internal_token,
            "TOLLGATE_MODELS": f"{self.config.model_name}={self.config.model_dir}",
            "TOLLGATE_ADAPTERS": ",".join(f"{n}={d}" for n, d in self.config.adapters.items()),
            **self.config.extra_env,
        }

    def public_env(self) -> dict[str, str]:
        """What admission and the ledger take beside the common settings."""
        env = {"TOLLGATE_ADMIN_TOKEN": self.config.admin_token}
        if self.config.tls_cert is not None and self.config.tls_key is not None:
            env["TOLLGATE_TLS_CERT"] = str(self.config.tls_cert)
            env["TOLLGATE_TLS_KEY"] = str(self.config.tls_key)
        return env

    def worker_env(self) -> dict[str, str]:
        # An empty TOLLGATE_WORKER_ID, whatever the caller's: each worker process names
        # itself uniquely.
        env = {
            "TOLLGATE_WORKER_ID": "",
            "TOLLGATE_KV_BLOCKS": str(self.config.num_kv_blocks),
            **self.config.engine_env,
        }
        chosen = any(
            name in os.environ or name in self.config.extra_env for name in THREAD_VARIABLES
        )
        if not chosen and physical_cores() >= RESERVE_FROM_CORES:
            env["TOLLGATE_RESERVED_CORES"] = COLOCATED_RESERVED_CORES
        return env

    def start(self, stopping: threading.Event | None = None) -> dict[str, ServiceProcess]:
        """Starts every service, each once the one before is ready; raises Stopped (every
        process started stopped again) once `stopping` is set."""
        self._stopping = stopping
        try:
            self._start_all("ledger", lambda _: self.public_env())
            # No static workers: each registers itself.
            no_workers = {"TOLLGATE_WORKERS": ""}
            schedulers = [p.address for p in self._start_all("scheduler", lambda _: no_workers)]
            # Every worker registers with every scheduler: whichever leads knows it.
            worker_env = {**self.worker_env(), "TOLLGATE_SCHEDULER_ADDRESS": ",".join(schedulers)}
            self._start_all("worker", lambda _: worker_env)
            self._start_all("admission", lambda i: self.admission_env(i, schedulers))
        except BaseException:
            self.stop()
            raise
        return self.processes

    def admission_env(self, index: int, schedulers: list[str]) -> dict[str, str]:
        """The first admission listens where the stack's gateway is; the others anywhere.
        Their hints and cancels go to the schedulers in turn."""
        return {
            **self.public_env(),
            "TOLLGATE_SCHEDULER_ADDRESS": schedulers[index % len(schedulers)],
            "TOLLGATE_LISTEN": self.config.gateway_listen if index == 0 else "127.0.0.1:0",
            "TOLLGATE_HTTP_LISTEN": self.config.http_listen if index == 0 else "127.0.0.1:0",
            "TOLLGATE_DISCONNECT_GRACE": str(self.config.disconnect_grace),
        }

    def _start_all(
        self, service: str, env_of: Callable[[int], Mapping[str, str]]
    ) -> list[ServiceProcess]:
        return [self._start(service, i, env_of(i)) for i in range(self.replicas[service])]

    def _start(self, service: str, index: int, env: Mapping[str, str]) -> ServiceProcess:
        name = service if index == 0 else f"{service}-{index + 1}"
        # On a port of its own unless the stack's environment says otherwise ("" = off).
        metrics = {"TOLLGATE_METRICS_LISTEN": f"127.0.0.1:{free_port()}"}
        env = {**metrics, **self.common_env(), **env}
        process = ServiceProcess(
            name, f"services.{service}", env, self.log_dir / f"{name}.log", service
        )
        self.processes[name] = process
        process.start()
        process.wait_ready(stopping=self._stopping)
        return process

    def stop(self) -> None:
        """Admission first, so no new work arrives while the rest drains."""
        for service in SERVICE_NAMES:
            for process in self.of(service):
                self.processes.pop(process.name).stop()
