"""Reading a tenant's runs from PostgreSQL: one run by its id or its idempotency key,
pages of them newest first, and how many it has queued."""

from __future__ import annotations

import base64
import binascii
from datetime import datetime

import sqlalchemy as sa

from services.core.auth import Principal
from services.core.db import Database, single_statement
from services.core.errors import FieldViolation, InvalidArgument, NotFound
from services.core.event_store import EventStore, view_from_row
from services.core.runs import RunView
from services.core.schema import runs
from services.core.validation import is_identifier, shown

MAX_PAGE_SIZE = 500
DEFAULT_PAGE_SIZE = 50
# A token this service issued is far shorter: base64 of a timestamp and a run id.
MAX_PAGE_TOKEN = 512


async def get_visible_run(store: EventStore, principal: Principal, run_id: str) -> RunView:
    """The run, if the caller's key may see it: a run of its tenant, of a model the key may
    generate with. Any other run does not exist for it."""
    run = await store.get_run(run_id) if is_identifier(run_id) else None
    if run is None or run.tenant_id != principal.tenant_id or not principal.may_use(run.model):
        raise NotFound(f"run {shown(run_id)} not found")
    return run


async def list_runs(
    db: Database, principal: Principal, page_size: int, page_token: str
) -> tuple[list[RunView], str]:
    """The runs the caller's key may see (`get_visible_run`), newest first."""
    if page_size < 0:
        raise InvalidArgument([FieldViolation("page_size", "must not be negative")])
    size = min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
    query = sa.select(runs).where(runs.c.tenant_id == principal.tenant_id)
    if principal.allowed_models:
        query = query.where(runs.c.model.in_(sorted(principal.allowed_models)))
    if page_token:
        created_at, run_id = _decode_token(page_token)
        query = query.where(
            sa.tuple_(runs.c.created_at, runs.c.run_id) < sa.tuple_(created_at, run_id)
        )
    query = query.order_by(runs.c.created_at.desc(), runs.c.run_id.desc()).limit(size + 1)
    async with single_statement(db) as conn:
        rows = [view_from_row(row._mapping) for row in await conn.execute(query)]
    if len(rows) <= size:
        return rows, ""
    page = rows[:size]
    last = page[-1]
    assert last.created_at is not None
    return page, _encode_token(last.created_at, last.run_id)


def _encode_token(created_at: datetime, run_id: str) -> str:
    return base64.urlsafe_b64encode(f"{created_at.isoformat()}|{run_id}".encode()).decode()


def _decode_token(token: str) -> tuple[datetime, str]:
    position = _parse_token(token) if len(token) <= MAX_PAGE_TOKEN else None
    if position is None:
        raise InvalidArgument([FieldViolation("page_token", "not a token this service issued")])
    return position


def _parse_token(token: str) -> tuple[datetime, str] | None:
    try:
        created_at, run_id = base64.urlsafe_b64decode(token.encode()).decode().split("|", 1)
        when = datetime.fromisoformat(created_at)
    except (ValueError, binascii.Error, UnicodeDecodeError):
        return None
    if when.tzinfo is None or not is_identifier(run_id):
        return None
    return when, run_id


async def find_by_idempotency_key(db: Database, tenant_id: str, key: str) -> RunView | None:
    async with single_statement(db) as conn:
        row = (
            await conn.execute(
                sa.select(runs).where(runs.c.tenant_id == tenant_id, runs.c.idempotency_key == key)
            )
        ).first()
    return view_from_row(row._mapping) if row else None


async def num_queued(db: Database, tenant_id: str, at_most: int) -> int:
    """The tenant's queued runs, counted up to `at_most` (index `runs_tenant_queued`)."""
    some = (
        sa.select(sa.literal(1))
        .where(runs.c.tenant_id == tenant_id, runs.c.state == "queued")
        .limit(at_most)
        .subquery()
    )
    async with single_statement(db) as conn:
        return int(await conn.scalar(sa.select(sa.func.count()).select_from(some)) or 0)
