"""A child process that dies with the process that started it.

Every service calls `follow_parent` first thing, so that a stack's services never
outlive `tollgate up` (or a test) when it is killed.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1
# Loaded here, not in the forked child, where dlopen could deadlock.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


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
