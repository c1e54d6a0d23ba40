"""A server child process that never outlives the process that started it."""

from __future__ import annotations

import pwd
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import structlog

from services.core.parent import die_with_parent

log = structlog.get_logger(__name__)

# Crash recovery after an unclean stop can take a while on a large data dir.
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0


class InfraError(RuntimeError):
    """A local server failed to start or to become ready."""


def as_user(user: str | None) -> dict[str, Any]:
    """Popen arguments that run the child as `user`, with that user's group only."""
    if user is None:
        return {}
    # Keeping our groups would let e.g. root's group bits deny what `user` may do.
    return {"user": user, "group": pwd.getpwnam(user).pw_gid, "extra_groups": []}


class ServerProcess:
    """A server child process writing to a log file, tied to this process's lifetime."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        *,
        user: str | None = None,
        stop_signal: signal.Signals = signal.SIGTERM,
    ) -> None:
        self.name = name
        self._argv = list(argv)
        self._log_path = log_path
        self._user = user
        self._stop_signal = stop_signal
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log.info(f"starting {self.name}", log_path=str(self._log_path))
        with open(self._log_path, "ab") as out:
            self._process = subprocess.Popen(
                self._argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                **as_user(self._user),
                # Own group: a terminal's Ctrl-C reaches only us, and we stop the servers in order.
                process_group=0,
                preexec_fn=die_with_parent(self._stop_signal),
            )

    def wait_ready(self, probe: Callable[[], bool], timeout: float = READY_TIMEOUT_S) -> None:
        assert self._process is not None
        deadline = time.monotonic() + timeout
        while not probe():
            status = self._process.poll()
            if status is not None:
                raise InfraError(f"{self.name} exited with status {status}\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise InfraError(f"{self.name} not ready after {timeout:.0f}s\n{self.log_tail()}")
            time.sleep(0.05)

    def log_tail(self, num_lines: int = 20) -> str:
        lines = self._log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-num_lines:])

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        process, self._process = self._process, None
        stop_process(self.name, process, self._stop_signal, timeout)


def stop_process(
    name: str,
    process: subprocess.Popen[Any] | None,
    stop_signal: signal.Signals = signal.SIGTERM,
    timeout: float = STOP_TIMEOUT_S,
) -> None:
    """Asks a child to stop with `stop_signal`, and kills it after `timeout`."""
    if process is None or process.poll() is not None:
        return
    log.info(f"stopping {name}", pid=process.pid)
    process.send_signal(stop_signal)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        log.warning(f"{name} did not stop, killing it", pid=process.pid)
        process.kill()
        process.wait()
