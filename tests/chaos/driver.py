"""Phases of chaos, each on a supervised stack of its own: load while processes are killed,
then the verdict from outside. `summary` makes the one JSON object the run ends with."""

from __future__ import annotations

import random
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from services.stack.infra import Endpoints
from tests.chaos.checks import Verdict, invariants, judge
from tests.chaos.cluster import HEARTBEAT_INTERVAL_S, Infra, Stack, supervised_stack, wait_until
from tests.chaos.faults import ALL_KINDS, Faults, WorkerKill
from tests.chaos.load import Load, RunRecord

log = structlog.get_logger(__name__)

EVERY_SERVICE_TWICE = {"admission": 2, "scheduler": 2, "worker": 2, "ledger": 2}
RECOVERY_TIMEOUT_S = 90.0
SETTLE_TIMEOUT_S = 60.0
MAX_LISTED = 5


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    duration_s: float
    replicas: dict[str, int] = field(default_factory=dict)
    kinds: tuple[str, ...] = ALL_KINDS
    gap_s: tuple[float, float] = (3.0, 6.0)
    # The workers' engine (TOLLGATE_ENGINE_*); none: the built-in one.
    engine_env: dict[str, str] = field(default_factory=dict)


@dataclass
class Outcome:
    phase: str
    records: list[RunRecord]
    kills: Counter[str]
    verdict: Verdict
    extra: dict[str, Any] = field(default_factory=dict)
    restart_seconds: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "runs": len(self.records),
            "kills": dict(sorted(self.kills.items())),
            "resumes": sum(r.num_resumes for r in self.records),
            "reopens": sum(r.num_reopens for r in self.records),
            "cancels": sum(r.cancel_requested for r in self.records),
            "invariant_violations": self.verdict.num_violations,
            "violations": {k: v[:MAX_LISTED] for k, v in self.verdict.violations.items()},
            "stuck_runs": len(self.verdict.stuck_run_ids),
            "stuck_run_ids": self.verdict.stuck_run_ids[:MAX_LISTED],
            "worker_kill_to_settled_s": latency(self.verdict.settle_seconds),
            "service_kill_to_serving_s": latency(self.restart_seconds),
            **self.extra,
        }


def latency(seconds: list[float]) -> dict[str, Any]:
    if not seconds:
        return {"n": 0, "p50": None, "max": None}
    return {
        "n": len(seconds),
        "p50": round(statistics.median(seconds), 3),
        "max": round(max(seconds), 3),
    }


def wait_recovered(stack: Stack) -> None:
    """Waits for every process to be up again (the supervisor restarts the killed)."""
    up = wait_until(
        lambda: all(p.exit_status() is None for p in stack.services.processes.values()),
        RECOVERY_TIMEOUT_S,
    )
    if not up:
        log.error("chaos: the stack did not recover", processes=list(stack.services.processes))


def settle(database_url: str) -> None:
    """Gives runs left in flight (a client gave up on them) time to end and be billed."""
    wait_until(lambda: invariants(database_url).ok, SETTLE_TIMEOUT_S, interval=2.0)


def run_phase(
    infra: Infra, endpoints: Endpoints, model_dir: Path, log_dir: Path, phase: Phase, seed: int
) -> Outcome:
    rng = random.Random(seed)
    with supervised_stack(endpoints, model_dir, log_dir, phase.replicas, phase.engine_env) as stack:
        load = Load(stack, seed=rng.randrange(2**32))
        faults = Faults(infra, stack, random.Random(rng.random()), phase.kinds, phase.gap_s)
        log.warning(f"chaos: phase {phase.name} for {phase.duration_s:.0f}s")
        load.start()
        faults.start()
        time.sleep(phase.duration_s)
        faults.stop()
        verdict = finish(stack, load, faults.worker_kills)
        return Outcome(
            phase.name, load.records, faults.kills, verdict, restart_seconds=faults.restart_seconds
        )


def finish(
    stack: Stack, load: Load, worker_kills: list[WorkerKill], more_workers: Sequence[str] = ()
) -> Verdict:
    """Lets the stack recover and the load drain, then judges what happened."""
    wait_recovered(stack)
    load.stop()
    settle(stack.database_url)
    config = stack.services.config
    return judge(
        stack.database_url,
        load.records,
        worker_kills,
        [*(p.address for p in stack.processes("worker")), *more_workers],
        (config.kafka_bootstrap, config.topic),
    )


def summary(outcomes: list[Outcome], skipped: dict[str, str]) -> dict[str, Any]:
    """The run's one JSON object: totals over the phases, and each phase's own."""
    kills: Counter[str] = Counter()
    for outcome in outcomes:
        kills.update(outcome.kills)
    phases = [o.summary() for o in outcomes]
    return {
        "runs": sum(p["runs"] for p in phases),
        "kills": dict(sorted(kills.items())),
        "resumes": sum(p["resumes"] for p in phases),
        "invariant_violations": sum(p["invariant_violations"] for p in phases),
        "stuck_runs": sum(p["stuck_runs"] for p in phases),
        "worker_kill_to_settled_s": latency(
            [s for o in outcomes for s in o.verdict.settle_seconds]
        ),
        "heartbeat_interval_s": HEARTBEAT_INTERVAL_S,
        "skipped": skipped,
        "phases": phases,
    }
