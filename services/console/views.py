"""The console's JSON: its dataclasses as the page reads them (no I/O)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from services.console.report_store import Latency, TenantTotal
from services.console.usage import DayUsage
from services.core.fleet import FleetView, WorkerLoad
from services.ledger.reconcile import InvariantReport

# The page shows a few of the runs that break an invariant; `tollgate reconcile` lists all.
SHOWN_RUN_IDS = 20


def day_json(day: DayUsage) -> dict[str, Any]:
    return {
        "day": day.day.isoformat(),
        "num_runs": day.num_runs,
        "quantities": day.quantities,
        "amount_micros": day.amount_micros,
    }


def fleet_json(fleet: FleetView | None) -> dict[str, Any]:
    if fleet is None:
        return {"available": False, "queues": {}, "workers": []}
    return {
        "available": True,
        "queues": {"interactive": fleet.num_interactive, "batch": fleet.num_batch},
        "num_running": fleet.num_running,
        "num_workers": fleet.num_workers,
        "num_free_blocks": fleet.num_free_blocks,
        "workers": [{**asdict(w), "kv_usage": _kv_usage(w)} for w in fleet.workers],
    }


def _kv_usage(worker: WorkerLoad) -> float | None:
    """The fraction of the worker's KV blocks in use; None before it reported its pool."""
    if worker.num_total_blocks <= 0:
        return None
    used = worker.num_total_blocks - worker.num_free_blocks
    return max(0.0, min(1.0, used / worker.num_total_blocks))


def latency_json(latency: Latency) -> dict[str, Any]:
    return {**asdict(latency), "tokens_per_second": latency.tokens_per_second}


def tenant_total_json(total: TenantTotal) -> dict[str, Any]:
    return asdict(total)


def reconciliation_json(report: InvariantReport, window_seconds: float) -> dict[str, Any]:
    broken = report.broken()
    return {
        "ok": report.ok,
        "window_seconds": window_seconds,
        "broken": {
            name: {"num_runs": len(ids), "run_ids": ids[:SHOWN_RUN_IDS]}
            for name, ids in broken.items()
        },
    }
