"""Keeps a stack's service processes running: one that dies is started again.

Each restart waits a backoff that doubles while a process keeps dying soon after it
started (from `INITIAL_BACKOFF_S` up to `MAX_BACKOFF_S`) and is forgiven once it stays
up for `STABLE_AFTER_S`.  A restarted process listens on the addresses it had, so the
processes and clients that know them need no news; its new pid goes to `on_restart` as
soon as it serves.  `stop()` ends a restart under way, backoff or wait alike.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from services.stack.launcher import ServiceProcess, Services, Stopped
from services.stack.server_process import InfraError

log = structlog.get_logger(__name__)

INITIAL_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
STABLE_AFTER_S = 60.0
POLL_INTERVAL_S = 0.2


@dataclass(slots=True)
class Backoff:
    """The wait before the next restart of one process (no I/O; callers pass the time)."""

    delay: float = 0.0
    started_at: float = 0.0

    def next_delay(self, now: float) -> float:
        if now - self.started_at >= STABLE_AFTER_S:
            self.delay = 0.0
        self.delay = min(MAX_BACKOFF_S, max(INITIAL_BACKOFF_S, self.delay * 2))
        return self.delay

    def started(self, now: float) -> None:
        self.started_at = now


class Supervisor:
    """Watches `services` in a thread of its own from `start()` until `stop()`."""

    def __init__(
        self, services: Services, on_restart: Callable[[ServiceProcess], None] = lambda _: None
    ) -> None:
        self.services = services
        self.on_restart = on_restart
        self.num_restarts = 0
        self._stopping = threading.Event()
        self._backoffs: dict[str, Backoff] = {}
        self._thread = threading.Thread(target=self._watch, name="supervisor", daemon=True)

    def start(self) -> None:
        now = time.monotonic()
        for name in self.services.processes:
            self._backoffs[name] = Backoff(started_at=now)
        self._thread.start()

    def stop(self) -> None:
        """Restarts nothing from now on; returns once a restart under way has given up
        (within `launcher.READY_POLL_S` and a health check)."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join()

    def _watch(self) -> None:
        while not self._stopping.wait(POLL_INTERVAL_S):
            for process in list(self.services.processes.values()):
                status = process.exit_status()
                if status is not None and not self._stopping.is_set():
                    self._restart(process, status)

    def _restart(self, process: ServiceProcess, status: int) -> None:
        backoff = self._backoffs.setdefault(process.name, Backoff())
        delay = backoff.next_delay(time.monotonic())
        old_pid = process.pid
        log.warning(
            f"{process.name} exited; restarting",
            exit_status=status,
            pid=old_pid,
            backoff_s=delay,
            log_path=str(process.log_path),
        )
        if self._stopping.wait(delay):
            return
        backoff.started(time.monotonic())
        try:
            process.restart(self._stopping)
        except InfraError as exc:  # it died again before it was ready: the next round retries
            log.error(f"{process.name} did not come back", error=str(exc))
            return
        except Stopped:  # the new process is stopped with the others
            log.info(f"{process.name} restart abandoned: stopping", pid=process.pid)
            return
        self.num_restarts += 1
        log.warning(f"{process.name} restarted", pid=process.pid, old_pid=old_pid)
        self.on_restart(process)
