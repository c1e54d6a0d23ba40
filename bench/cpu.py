"""CPU time a benchmark and the processes it started spent over a window, by role.

A side of a benchmark that is slower than the other either waits or runs out of
cores: the CPU seconds each process spent, against the seconds the machine's cores
offered over the same wall time, tell which.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import psutil

BENCH = "bench"
ENGINE = "engine"
POSTGRES = "postgres"
BROKER = "broker"
OTHER = "other"


def role(cmdline: Sequence[str], name: str, is_self: bool) -> str:
    """What a process is, from its command line: the bench itself, a service
    (`python -m services.<name>`), an engine process (a spawned multiprocessing child, or
    an engine server such as llama-server), the database, the broker, or other."""
    if is_self:
        return BENCH
    if "-m" in cmdline[:-1]:
        module = cmdline[cmdline.index("-m") + 1]
        if module.startswith("services."):
            return module.removeprefix("services.")
    if any("spawn_main" in arg for arg in cmdline):
        return ENGINE
    program = os.path.basename(cmdline[0]) if cmdline else name
    if program.startswith("llama-server"):
        return ENGINE
    if name.startswith("postgres") or program.startswith("postgres"):
        return POSTGRES
    if program.startswith("tansu") or cmdline[1:2] == ["broker"]:
        return BROKER
    return OTHER


def _cpu_seconds_by_pid() -> dict[int, tuple[str, float]]:
    """(role, user + system CPU seconds) of this process and all its descendants."""
    me = psutil.Process()
    seen: dict[int, tuple[str, float]] = {}
    for process in [me, *me.children(recursive=True)]:
        try:
            with process.oneshot():
                times = process.cpu_times()
                kind = role(process.cmdline(), process.name(), process.pid == me.pid)
        except psutil.Error:
            continue  # exited meanwhile
        seen[process.pid] = (kind, times.user + times.system)
    return seen


@dataclass
class CpuWindow:
    """CPU seconds per role between entering and leaving the block, with its wall time.

    Processes started inside the window count from zero; a process that exits inside
    it loses its CPU time (postgres backends of closed connections, mostly).
    """

    seconds: dict[str, float] = field(default_factory=dict)
    wall_seconds: float = 0.0
    num_cores: int = field(default_factory=lambda: psutil.cpu_count() or 1)

    def __enter__(self) -> CpuWindow:
        self._before = _cpu_seconds_by_pid()
        self._started = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall_seconds = time.perf_counter() - self._started
        totals: defaultdict[str, float] = defaultdict(float)
        for pid, (kind, seconds) in _cpu_seconds_by_pid().items():
            before = self._before.get(pid)
            totals[kind] += seconds - (before[1] if before else 0.0)
        self.seconds = dict(sorted(totals.items(), key=lambda item: -item[1]))

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())

    @property
    def busy_fraction(self) -> float:
        """The share of the cores' seconds over the window that the processes used."""
        offered = self.wall_seconds * self.num_cores
        return self.total_seconds / offered if offered > 0 else 0.0

    def describe(self) -> str:
        parts = ", ".join(f"{kind} {seconds:.2f}" for kind, seconds in self.seconds.items())
        return (
            f"{parts}; {self.total_seconds:.2f} CPU-s in {self.wall_seconds:.2f} s on "
            f"{self.num_cores} cores ({self.busy_fraction:.0%} busy)"
        )

    def ms_per_run(self, runs: int, exclude: Sequence[str] = ()) -> dict[str, float]:
        """CPU milliseconds per run of each role but `exclude`."""
        return {
            kind: round(1000 * seconds / runs, 2)
            for kind, seconds in self.seconds.items()
            if kind not in exclude
        }

    def percent_of_a_core(self, exclude: Sequence[str] = ()) -> dict[str, float]:
        """Each role's CPU over the window's wall time, in percent of one core."""
        return {
            kind: round(100 * seconds / self.wall_seconds, 2)
            for kind, seconds in self.seconds.items()
            if kind not in exclude
        }

    def rounded(self) -> Mapping[str, float]:
        return {kind: round(seconds, 3) for kind, seconds in self.seconds.items()}


def combined(windows: Sequence[CpuWindow]) -> CpuWindow:
    """One window of the windows' CPU seconds by role and their wall seconds, summed."""
    totals: defaultdict[str, float] = defaultdict(float)
    for window in windows:
        for kind, seconds in window.seconds.items():
            totals[kind] += seconds
    return CpuWindow(
        seconds=dict(sorted(totals.items(), key=lambda item: -item[1])),
        wall_seconds=sum(window.wall_seconds for window in windows),
        num_cores=windows[0].num_cores if windows else psutil.cpu_count() or 1,
    )
