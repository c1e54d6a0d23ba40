"""Metrics of the ledger: committed bills, spend, billing latency, and runs the sweep
could not bill."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from services.core.metrics import TENANTS
from services.ledger.billing import Bill

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

BILLED_RUNS = Counter(
    "tollgate_ledger_billed_runs", "Runs billed, by how the ledger learned of them", ["source"]
)
BILLED_AMOUNT = Counter(
    "tollgate_ledger_billed_amount_micros",
    "Amount billed in micro-units of the currency",
    ["currency", "model_name", "tenant"],
)
RELEASED_RESERVATIONS = Counter(
    "tollgate_ledger_released_reservations", "KV reservations released by billing"
)
BILLING_LATENCY = Histogram(
    "tollgate_ledger_billing_latency_seconds",
    "Time from a run's terminal event to its billed event",
    buckets=_LATENCY_BUCKETS,
)
E2E_LATENCY = Histogram(
    "tollgate_e2e_request_latency_seconds",
    "Time from a run's admission to its terminal event (queue, retries and generation)",
    ["model_name", "tenant"],
    buckets=_LATENCY_BUCKETS,
)

SWEEP_FAILURES = Counter(
    "tollgate_ledger_sweep_failures", "Runs the sweep failed to bill (each retried next round)"
)


def record_bill(bill: Bill, source: str) -> None:
    tenant = TENANTS.of(bill.tenant_id)
    BILLED_RUNS.labels(source=source).inc()
    BILLED_AMOUNT.labels(bill.currency, bill.model, tenant).inc(bill.amount_micros)
    RELEASED_RESERVATIONS.inc(bill.num_released)
    if bill.billing_seconds is not None:
        BILLING_LATENCY.observe(bill.billing_seconds)
    if bill.run_seconds is not None:
        E2E_LATENCY.labels(bill.model, tenant).observe(bill.run_seconds)
