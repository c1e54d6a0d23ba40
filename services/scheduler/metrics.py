"""Prometheus metrics of the scheduler process."""

from __future__ import annotations

import functools

from prometheus_client import Counter, Gauge, Histogram

from services.scheduler.fair_queue import CLASS_ORDER
from services.scheduler.state import SchedulerState

QUEUE_DEPTH = Gauge("tollgate_scheduler_queue_depth", "Runs waiting for a worker", ["queue_class"])
RUNNING = Gauge("tollgate_scheduler_running_runs", "Runs assigned to workers")
WORKERS = Gauge("tollgate_scheduler_workers", "Live workers")
DISPATCHES = Counter("tollgate_scheduler_dispatches", "AssignRun calls by outcome", ["outcome"])
QUEUE_SECONDS = Histogram(
    "tollgate_scheduler_queue_seconds",
    "Time from a run's queued event to its assignment",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
WORKERS_LOST = Counter("tollgate_scheduler_workers_lost", "Workers declared lost")
RUNS_RECOVERED = Counter(
    "tollgate_scheduler_runs_recovered", "Runs of lost workers by outcome", ["outcome"]
)


def observe_state(state: SchedulerState) -> None:
    """Gauges read the live state at scrape time."""
    for queue_class in CLASS_ORDER:
        QUEUE_DEPTH.labels(queue_class=str(queue_class)).set_function(
            functools.partial(state.queue.count, queue_class)
        )
    RUNNING.set_function(lambda: len(state.assignments))
    WORKERS.set_function(lambda: sum(1 for _ in state.registry.alive()))
