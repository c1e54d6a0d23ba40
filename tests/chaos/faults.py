"""SIGKILLs at random moments: any service process, a worker's engine child, the broker
(restarted empty on its port), PostgreSQL (restarted on its data directory).

For each worker or engine killed, the runs it held are noted with the moment of the kill,
so that the checks can measure how long those runs took to be re-queued or failed.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import structlog

from services.stack.launcher import ServiceProcess
from tests.chaos.cluster import Infra, Stack, engine_child, wait_until
from tests.chaos.evidence import held_runs
from tests.services.core.kafka_tools import accepts

log = structlog.get_logger(__name__)

SERVICE_KINDS = ("admission", "scheduler", "worker", "ledger")
ALL_KINDS = (*SERVICE_KINDS, "engine", "broker", "postgres")
RESTART_WATCH_S = 600.0


@dataclass(frozen=True, slots=True)
class WorkerKill:
    kind: str  # "worker" or "engine"
    worker_pid: int
    at: float  # time.time() of the kill
    run_ids: tuple[str, ...]


@dataclass
class Faults:
    """Kills one of `kinds` every `gap_s` (drawn uniformly) from `start()` to `stop()`,
    each kind once in every round of them."""

    infra: Infra
    stack: Stack
    rng: random.Random
    kinds: tuple[str, ...] = ALL_KINDS
    gap_s: tuple[float, float] = (3.0, 7.0)
    kills: Counter[str] = field(default_factory=Counter)
    worker_kills: list[WorkerKill] = field(default_factory=list)
    # Seconds from a service process's kill until its successor accepts connections.
    restart_seconds: list[float] = field(default_factory=list)
    _stopping: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="faults", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()

    def _loop(self) -> None:
        # Every kind once per round, in a new order each round.
        order: list[str] = []
        while not self._stopping.wait(self.rng.uniform(*self.gap_s)):
            if not order:
                order = self.rng.sample(self.kinds, len(self.kinds))
            kind = order.pop()
            try:
                if self.kill(kind):
                    self.kills[kind] += 1
            except Exception:  # one failed kill must not end the chaos
                log.exception("kill failed", kind=kind)

    def kill(self, kind: str) -> bool:
        """Kills one process of `kind`; False when none was up to be killed."""
        if kind == "broker":
            log.warning("chaos: killing the broker, restarting it empty")
            self.infra.restart_broker_empty()
            return True
        if kind == "postgres":
            log.warning("chaos: killing postgres")
            self.infra.restart_postgres()
            return True
        victim = self._running(kind)
        if victim is None:
            return False
        if kind == "engine":
            return self._kill_engine(victim)
        runs = held_runs(self.stack.database_url, victim.pid) if kind == "worker" else ()
        log.warning(f"chaos: killing {victim.name}", pid=victim.pid)
        old_pid = victim.pid
        os.kill(old_pid, signal.SIGKILL)
        at = time.time()
        if kind == "worker":
            self.worker_kills.append(WorkerKill(kind, old_pid, at, runs))
        watch = threading.Thread(target=self._time_restart, args=(victim, old_pid, at), daemon=True)
        watch.start()
        return True

    def _time_restart(self, victim: ServiceProcess, old_pid: int, at: float) -> None:
        port = int(victim.address.rpartition(":")[2])

        def back() -> bool:
            return _is_up(victim) and victim.pid != old_pid and accepts(port)

        if wait_until(back, RESTART_WATCH_S, interval=0.1):
            self.restart_seconds.append(time.time() - at)

    def _kill_engine(self, worker: ServiceProcess) -> bool:
        engine = engine_child(worker)
        if engine is None:
            return False
        runs = held_runs(self.stack.database_url, worker.pid)
        log.warning(f"chaos: killing the engine of {worker.name}", pid=engine.pid)
        engine.kill()
        self.worker_kills.append(WorkerKill("engine", worker.pid, time.time(), runs))
        return True

    def _running(self, kind: str) -> ServiceProcess | None:
        service = "worker" if kind == "engine" else kind
        alive = [p for p in self.stack.processes(service) if _is_up(p)]
        return self.rng.choice(alive) if alive else None


def _is_up(process: ServiceProcess) -> bool:
    return process.process is not None and process.exit_status() is None
