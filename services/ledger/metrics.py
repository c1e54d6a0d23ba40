"""Prometheus metrics of the ledger: committed bills, and runs the sweep could not bill."""

from __future__ import annotations

from prometheus_client import Counter

from services.ledger.billing import Bill

BILLED_RUNS = Counter(
    "tollgate_ledger_billed_runs", "Runs billed, by how the ledger learned of them", ["source"]
)
BILLED_AMOUNT = Counter(
    "tollgate_ledger_billed_amount_micros", "Amount billed in micro-units", ["currency"]
)
RELEASED_RESERVATIONS = Counter(
    "tollgate_ledger_released_reservations", "KV reservations released by billing"
)

SWEEP_FAILURES = Counter(
    "tollgate_ledger_sweep_failures", "Runs the sweep failed to bill (each retried next round)"
)


def record_bill(bill: Bill, source: str) -> None:
    BILLED_RUNS.labels(source=source).inc()
    BILLED_AMOUNT.labels(currency=bill.currency).inc(bill.amount_micros)
    RELEASED_RESERVATIONS.inc(bill.num_released)
