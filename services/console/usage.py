"""Usage and spend per UTC day, through the ledger's own report (`GetUsage`'s code).

Admission reads the ledger's tables in the database both share, so the console needs no
channel to the ledger process and its figures are the ones `GetUsage` answers.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta

from services.core.db import Database
from services.ledger import reports

MAX_DAYS = 90


@dataclass(frozen=True, slots=True)
class DayUsage:
    day: date
    num_runs: int
    quantities: dict[str, int]  # billing type -> quantity
    amount_micros: int


async def daily_usage(
    db: Database, tenant_id: str | None, num_days: int, currency: str, today: date
) -> list[DayUsage]:
    """The last `num_days` days up to `today`, oldest first; a day without runs reads
    zeros. `tenant_id` None: every tenant."""
    days = [today - timedelta(days=back) for back in range(num_days - 1, -1, -1)]
    # One day at a time, in turn: a report is one indexed aggregate, and the pool is
    # shared with the runs being served.
    return [await _day(db, tenant_id, day, currency) for day in days]


async def _day(db: Database, tenant_id: str | None, day: date, currency: str) -> DayUsage:
    start = datetime.combine(day, time(), UTC)
    usage = await reports.usage(db, tenant_id, start, start + timedelta(days=1), currency)
    return DayUsage(
        day=day,
        num_runs=usage.num_runs,
        quantities={line.billing_type: line.quantity for line in usage.lines},
        amount_micros=usage.amount_micros,
    )
