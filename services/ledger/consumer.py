"""The ledger's Kafka consumer: bills each terminal event exactly once."""

from __future__ import annotations

from collections.abc import Sequence

import structlog
from sqlalchemy.ext.asyncio import AsyncConnection

from services.core.config import RUN_EVENTS_TOPIC, consumer_group
from services.core.consumer import TrackingConsumer
from services.core.db import Database
from services.core.idle import IdleFetch
from services.core.pricing import PriceTable
from services.core.runs import TERMINAL_STATES, StoredEvent
from services.core.telemetry import bound_log_context
from services.ledger.billing import Bill, bill_run
from services.ledger.metrics import record_bill

LEDGER_GROUP = "tollgate-ledger"

log = structlog.get_logger(__name__)


class LedgerConsumer(TrackingConsumer):
    """A TrackingConsumer of terminal events whose handler is `bill_run`."""

    def __init__(
        self,
        db: Database,
        bootstrap: str,
        prices: PriceTable,
        *,
        topic: str = RUN_EVENTS_TOPIC,
        session_timeout_ms: int = 10_000,
    ) -> None:
        # Tracking rows carry the plain name whatever the topic: a run is billed once.
        super().__init__(
            db,
            bootstrap,
            group_id=consumer_group(LEDGER_GROUP, topic),
            handler=self.bill,
            kinds=TERMINAL_STATES,
            topic=topic,
            name=LEDGER_GROUP,
            session_timeout_ms=session_timeout_ms,
            # Brokers that answer an empty fetch only when this wait is over (the embedded
            # one) are asked 10 times a second, not 20: each round costs the broker and the
            # ledger CPU. Billing is what waits, not the tokens. None is asked while the
            # store is quiet (`idle`).
            fetch_max_wait_ms=100,
            idle=IdleFetch(db),
        )
        self.prices = prices
        self._pending: list[Bill] = []

    async def bill(self, conn: AsyncConnection, event: StoredEvent) -> None:
        with bound_log_context(run_id=event.run_id, tenant_id=event.tenant_id, seq=event.seq):
            # The billing span continues the run's own trace (`bill_run`).
            bill = await bill_run(conn, event.run_id, self.prices)
        if bill is not None:
            self._pending.append(bill)

    async def apply(self, events: Sequence[StoredEvent]) -> int:
        # Metrics count what committed: a batch whose transaction fails is retried.
        self._pending = []
        applied = await super().apply(events)
        for bill in self._pending:
            record_bill(bill, "consumer")
            log.info(
                "run billed",
                run_id=bill.run_id,
                tenant_id=bill.tenant_id,
                seq=bill.seq,
                amount_micros=bill.amount_micros,
            )
        self._pending = []
        return applied
