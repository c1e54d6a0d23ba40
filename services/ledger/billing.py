"""Billing one terminal run, inside the caller's transaction.

The consumer and the sweep both bill through `bill_run`.  It locks the run's
projection row first, so when both reach the same run one waits for the other
and then finds it billed: a duplicate is a no-op, never an error that would
abort the caller's transaction.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import structlog
from sqlalchemy.ext.asyncio import AsyncConnection

from services.core.event_store import Append, append_in
from services.core.pricing import (
    BillableRun,
    LedgerEntry,
    PriceTable,
    TokenUsage,
    billed_payload,
    price_run,
    total_micros,
)
from services.core.runs import NewEvent, RunState, RunView, is_terminal
from services.core.telemetry import context_from_traceparent, current_traceparent, get_tracer
from services.ledger import ledger_store

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Bill:
    """What billing a run wrote."""

    run_id: str
    tenant_id: str
    seq: int  # of the `billed` event
    amount_micros: int
    currency: str
    entries: tuple[LedgerEntry, ...]
    num_released: int
    model: str = ""
    # Seconds from the run's creation to its terminal event, and from that to `billed`
    # (both of the database's clock); None where the row has no times.
    run_seconds: float | None = None
    billing_seconds: float | None = None


async def bill_run(conn: AsyncConnection, run_id: str, prices: PriceTable) -> Bill | None:
    """Bills a terminal run once; None when there is nothing to do.

    In the caller's transaction: ledger entries for the usage in the run's
    projection, release of its KV reservation, and the `billed` event.
    Returns None for a run that is unknown, already billed or not terminal.
    """
    locked = await ledger_store.lock_run(conn, run_id)
    if locked is None:
        log.warning("cannot bill an unknown run", run_id=run_id)
        return None
    view, traceparent = locked
    if view.state == RunState.BILLED:
        log.debug("run already billed", run_id=run_id)
        return None
    if not is_terminal(view.state):
        log.warning("cannot bill a run that has not ended", run_id=run_id, state=view.state)
        return None
    parent = context_from_traceparent(traceparent)
    with get_tracer().start_as_current_span("tollgate.ledger.bill", context=parent) as span:
        span.set_attributes(
            {
                "tollgate.run_id": run_id,
                "tollgate.tenant_id": view.tenant_id,
                "gen_ai.request.model": view.model,
            }
        )
        bill = await _bill(conn, view, prices)
        span.set_attributes(
            {
                "tollgate.seq": bill.seq,
                "tollgate.amount_micros": bill.amount_micros,
                "tollgate.currency": bill.currency,
            }
        )
        return bill


async def _bill(conn: AsyncConnection, view: RunView, prices: PriceTable) -> Bill:
    run = billable(view)
    # What the ledger holds after the insert, not what was meant to be inserted: the
    # stored rows carry their timestamps, and `billed` must describe exactly those.
    entries, num_released = await ledger_store.write_bill(conn, run, price_run(run, prices))
    payload = billed_payload(entries, prices.currency)
    [billed] = await append_in(
        conn,
        Append(
            run.run_id,
            view.last_seq,
            [NewEvent(RunState.BILLED, payload)],
            traceparent=current_traceparent(),
            locked=view,
        ),
    )
    return Bill(
        run_id=run.run_id,
        tenant_id=run.tenant_id,
        seq=billed.seq,
        amount_micros=total_micros(entries),
        currency=prices.currency,
        entries=tuple(entries),
        num_released=num_released,
        model=view.model,
        run_seconds=_seconds(view.created_at, view.updated_at),
        billing_seconds=_seconds(view.updated_at, billed.created_at),
    )


def _seconds(start: datetime | None, end: datetime | None) -> float | None:
    return None if start is None or end is None else max(0.0, (end - start).total_seconds())


def billable(view: RunView) -> BillableRun:
    return BillableRun(
        run_id=view.run_id,
        tenant_id=view.tenant_id,
        # Admission always sets one; the fallback mirrors its convention.
        idempotency_key=view.idempotency_key or f"run:{view.run_id}",
        model=view.model,
        usage=TokenUsage.from_payload(view.usage),
        priority=view.priority,
    )
