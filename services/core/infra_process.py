"""A server child process that never outlives the process that started it."""

from __future__ import annotations

import ctypes
import os
import pwd
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger(__name__)

# Crash recovery after an unclean stop can take a while on a large data dir.
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0

_PR_SET_PDEATHSIG = 1
# Loaded here, not in the forked child, where dlopen could deadlock.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


class InfraError(RuntimeError):
    """A local server failed to start or to become ready."""


def die_with_parent(sig: signal.Signals, parent: int | None = None) -> Callable[[], None] | None:
    """A preexec_fn making the kernel send `sig` to the child when this thread dies (or,
    called in the child itself, when the thread that started it dies; `parent` is then
    the pid that started it)."""
    libc = _LIBC
    if libc is None:
        return None
    parent = os.getpid() if parent is None else parent

    def preexec() -> None:
        # Runs after Popen's setuid, which would otherwise clear the setting.
        libc.prctl(_PR_SET_PDEATHSIG, int(sig))
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


# Names the process, and the signal, that a service started with it must die with.
PARENT_ENV = "TOLLGATE_DIE_WITH_PARENT"


def die_with_parent_env(sig: signal.Signals) -> dict[str, str]:
    """The environment that has a Python child call `die_with_parent` itself, first thing.

    Unlike a preexec_fn, it lets Popen use vfork: a fork of a process running gRPC
    threads can abort in the child before it execs (gRPC's after-fork handler restarts
    its poller while Popen closes the poller's descriptor).
    """
    return {PARENT_ENV: f"{os.getpid()}:{int(sig)}"} if _LIBC is not None else {}


def follow_parent() -> None:
    """In a child started with `die_with_parent_env`: get its signal when the parent dies."""
    value = os.environ.pop(PARENT_ENV, "")  # not for this process's own children
    if not value:
        return
    parent, sig = (int(part) for part in value.split(":"))
    preexec = die_with_parent(signal.Signals(sig), parent)
    if preexec is not None:
        preexec()


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
        log.info(f"starting {self.name}", log=str(self._log_path))
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
