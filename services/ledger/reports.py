"""The read side of the ledger: entries and usage, scoped by caller (reconciliation:
`reconcile.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from services.core import paging
from services.core.auth import Principal
from services.core.db import Database
from services.core.errors import FieldViolation, InvalidArgument, NotFound, PermissionDenied
from services.core.pricing import BILLING_TYPES, LedgerEntry
from services.core.quota_store import load_limits, subjects, usage_now
from services.core.quotas import SubjectUsage, remaining, used, window_reset
from services.core.validation import is_identifier, shown
from services.ledger import ledger_store


def visible_tenant(principal: Principal, requested: str) -> str | None:
    """The tenant a request may read; None means every tenant (admin only)."""
    if principal.is_admin:
        if requested and not is_identifier(requested):
            raise InvalidArgument([FieldViolation("tenant_id", "is not a tenant id")])
        return requested or None
    if requested and requested != principal.tenant_id:
        raise PermissionDenied("an API key reads only its own tenant's ledger")
    return principal.tenant_id


LIMIT_NAMES = (
    "budget_micros",
    "requests_per_minute",
    "input_tokens_per_minute",
    "output_tokens_per_minute",
    "max_concurrent_runs",
    "max_kv_blocks",
)


@dataclass(frozen=True, slots=True)
class EntriesPage:
    entries: list[LedgerEntry]
    next_page_token: str


async def list_entries(
    db: Database,
    tenant_id: str | None,
    run_id: str,
    requested_page_size: int,
    page_token: str,
) -> EntriesPage:
    try:
        size = paging.page_size(requested_page_size)
        after = paging.decode(page_token, _scope(tenant_id, run_id))
    except paging.BadPageRequest as exc:
        raise InvalidArgument([FieldViolation(exc.field, exc.description)]) from None
    where = ledger_store.EntryFilter(tenant_id, run_id or None)
    async with db.connect() as conn:
        if run_id:
            owner = await ledger_store.run_tenant(conn, run_id) if is_identifier(run_id) else None
            if owner is None or (tenant_id is not None and owner != tenant_id):
                raise NotFound(f"run {shown(run_id)} not found")
        position = (after.created_at, after.entry_id) if after else None
        rows = await ledger_store.list_entries(conn, where, position, size + 1)
    page, more = rows[:size], len(rows) > size
    token = ""
    if more:
        last = page[-1]
        assert last.created_at is not None
        key = paging.PageKey(last.created_at, last.entry_id, _scope(tenant_id, run_id))
        token = paging.encode(key)
    return EntriesPage(page, token)


def _scope(tenant_id: str | None, run_id: str) -> str:
    return f"{tenant_id or '*'}/{run_id or '*'}"


@dataclass(frozen=True, slots=True)
class UsageLine:
    billing_type: str
    quantity: int
    amount_micros: int


@dataclass(frozen=True, slots=True)
class Usage:
    tenant_id: str | None
    num_runs: int
    lines: list[UsageLine]
    amount_micros: int
    currency: str


async def usage(
    db: Database,
    tenant_id: str | None,
    start: datetime | None,
    end: datetime | None,
    currency: str,
) -> Usage:
    """Totals of entries created in [start, end), one line per billing type."""
    if start is not None and end is not None and end < start:
        raise InvalidArgument([FieldViolation("end_time", "must not be before start_time")])
    async with db.connect() as conn:
        totals = await ledger_store.usage_totals(conn, tenant_id, start, end)
    # The standard types always appear, so a client reads zeros rather than absences.
    types = [*BILLING_TYPES, *sorted(set(totals.quantities) - set(BILLING_TYPES))]
    lines = [UsageLine(t, totals.quantities.get(t, 0), totals.amounts.get(t, 0)) for t in types]
    amount = sum(line.amount_micros for line in lines)
    return Usage(tenant_id, totals.num_runs, lines, amount, currency)


@dataclass(frozen=True, slots=True)
class LimitStanding:
    """One limit set for a tenant or key, and where it stands now."""

    subject: str
    name: str
    limit: int
    used: int
    remaining: int
    reset_time: datetime | None
    budget_period: str = ""


async def limits(db: Database, tenant_id: str, key_id: str = "") -> list[LimitStanding]:
    """Every limit set for the tenant (and for its key `key_id`), read as admission reads
    them but without the tenant's lock."""
    async with db.connect() as conn:
        found = await load_limits(conn, tenant_id, key_id)
        if found is None:
            return []
        snapshot = await usage_now(conn, subjects(tenant_id, key_id, found))
    return [standing for usage in snapshot.usages for standing in _standings(usage)]


def _standings(usage: SubjectUsage) -> list[LimitStanding]:
    found = []
    window_end = datetime.fromtimestamp(usage.now + window_reset(usage), UTC)
    for name in LIMIT_NAMES:
        limit = getattr(usage.limits, name)
        if not limit:
            continue
        left = remaining(usage, name)
        reset: datetime | None = window_end if name.endswith("_per_minute") else None
        period = ""
        if name == "budget_micros":
            reset = datetime.fromtimestamp(usage.period_end or usage.now, UTC)
            period = usage.limits.budget_period
        held = used(usage, name)
        found.append(LimitStanding(usage.subject, name, limit, held, left, reset, period))
    return found
