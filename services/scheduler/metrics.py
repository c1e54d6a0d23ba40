"""Prometheus metrics of the scheduler process."""

from __future__ import annotations

import collections
import functools
import time
from collections.abc import Iterator, Mapping

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, Metric
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from services.core.metrics import TENANTS
from services.scheduler.fair_queue import CLASS_ORDER
from services.scheduler.records import QueuedRun
from services.scheduler.state import SchedulerState

QUEUE_DEPTH = Gauge("tollgate_scheduler_queue_depth", "Runs waiting for a worker", ["queue_class"])
RUNNING = Gauge("tollgate_scheduler_running_runs", "Runs assigned to workers")
WORKERS = Gauge("tollgate_scheduler_workers", "Live workers")
DISPATCHES = Counter("tollgate_scheduler_dispatches", "AssignRun calls by outcome", ["outcome"])
QUEUE_TIME = Histogram(
    "tollgate_request_queue_time_seconds",
    "Time from a run's queued event to its assignment to a worker",
    ["model_name", "tenant"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
WORKERS_LOST = Counter("tollgate_scheduler_workers_lost", "Workers declared lost")
RUNS_RECOVERED = Counter(
    "tollgate_scheduler_runs_recovered", "Runs of lost workers by outcome", ["outcome"]
)


class WaitingRuns(Collector):
    """`tollgate_num_requests_waiting`, counted at scrape time from the queued runs."""

    def __init__(self) -> None:
        self.queued: Mapping[str, QueuedRun] = {}

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "tollgate_num_requests_waiting",
            "Runs queued for a worker",
            labels=["model_name", "tenant"],
        )
        runs = list(self.queued.values())
        counts = collections.Counter((run.model, TENANTS.of(run.tenant_id)) for run in runs)
        for labels, count in sorted(counts.items()):
            family.add_metric(list(labels), count)
        yield family


WAITING = WaitingRuns()
REGISTRY.register(WAITING)


def observe_queue_time(run: QueuedRun) -> float:
    """Records how long `run` waited; returns it."""
    waited = max(0.0, time.time() - run.queued_at)
    QUEUE_TIME.labels(run.model, TENANTS.of(run.tenant_id)).observe(waited)
    return waited


def observe_state(state: SchedulerState) -> None:
    """Gauges read the live state at scrape time."""
    WAITING.queued = state.queued
    for queue_class in CLASS_ORDER:
        QUEUE_DEPTH.labels(queue_class=str(queue_class)).set_function(
            functools.partial(state.queue.count, queue_class)
        )
    RUNNING.set_function(lambda: len(state.assignments))
    WORKERS.set_function(lambda: sum(1 for _ in state.registry.alive()))
