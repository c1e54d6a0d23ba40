"""The sweep: bills terminal runs whose terminal event never reached the consumer.

Kafka may lose events (and the embedded broker keeps none across restarts), so
the `runs` projection, not the topic, decides what is owed.  A run is swept
only after a grace period, leaving the consumer the first chance; a late
delivery after the sweep finds the run billed and does nothing. A run that
cannot be billed (its usage unreadable, say) is logged and counted, and the
round goes on with the others.
"""

from __future__ import annotations

import asyncio

import structlog
from sqlalchemy.exc import InterfaceError, OperationalError

from services.core.db import Database, single_statement
from services.core.pricing import PriceTable
from services.core.runs import EventStoreError
from services.core.telemetry import bound_log_context
from services.ledger import ledger_store
from services.ledger.billing import Bill, bill_run
from services.ledger.metrics import SWEEP_FAILURES, record_bill

log = structlog.get_logger(__name__)


class Sweeper:
    def __init__(
        self,
        db: Database,
        prices: PriceTable,
        *,
        interval: float = 5.0,
        grace: float = 10.0,
        batch_size: int = 100,
    ) -> None:
        self.db = db
        self.prices = prices
        self.interval = interval
        self.grace = grace
        self.batch_size = batch_size

    async def run(self) -> None:
        """Sweeps every `interval` seconds until cancelled."""
        while True:
            try:
                await self.sweep_once()
            except Exception as exc:  # the database may be briefly away: try next round
                log.warning("sweep failed", error=str(exc))
            await asyncio.sleep(self.interval)

    async def sweep_once(self) -> list[Bill]:
        """Bills every overdue run, each in its own transaction; returns the bills."""
        bills: list[Bill] = []
        # Runs this round did not bill (one failed, or was billed elsewhere meanwhile): the
        # next batch reads past them, and the next round tries them again.
        passed: set[str] = set()
        while True:
            limit = self.batch_size + len(passed)
            async with single_statement(self.db) as conn:
                run_ids = await ledger_store.overdue_run_ids(conn, self.grace, limit=limit)
            for run_id in (r for r in run_ids if r not in passed):
                bill = await self.bill_one(run_id)
                if bill is None:
                    passed.add(run_id)
                else:
                    bills.append(bill)
            if len(run_ids) < limit:
                return bills

    async def bill_one(self, run_id: str) -> Bill | None:
        # The billing span continues the run's own trace (`bill_run`).
        with bound_log_context(run_id=run_id):
            try:
                async with self.db.begin() as conn:
                    bill = await bill_run(conn, run_id, self.prices)
            except EventStoreError as exc:
                log.warning("sweep could not bill run", error=str(exc))
                return None
            except (OperationalError, InterfaceError):
                raise  # the database is away: the round ends, the next one tries again
            except Exception:
                # This run alone: the others of the round are billed all the same.
                SWEEP_FAILURES.inc()
                log.exception("sweep failed to bill run; going on with the others")
                return None
        if bill is not None:
            record_bill(bill, "sweep")
            log.info(
                "unbilled run swept",
                tenant_id=bill.tenant_id,
                seq=bill.seq,
                amount_micros=bill.amount_micros,
            )
        return bill
