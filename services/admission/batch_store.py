"""Batches of the Batch API in PostgreSQL: a `batches` row each, and a `batch_lines` row
for each line that was submitted (its run) or refused when it was to start (its error).

A batch moves `validating` -> `in_progress` -> `finalizing` -> `completed`, or to
`cancelling` -> `cancelled`, or to `expired` past its window, or to `failed`; each move
is one conditional update, so two drivers (an old leader not yet stopped, a new one)
cannot both make it. Its `request_counts` are read from its lines' runs, never kept
apart from them.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.engine import RowMapping
from sqlalchemy.ext.asyncio import AsyncConnection

from services.admission.file_store import OPEN_STATUSES, page
from services.core.db import Database, single_statement
from services.core.schema import batch_lines, batches, runs

USAGE_NAMES = ("prompt_tokens", "cached_prompt_tokens", "output_tokens")
# A run that ended without its answer: a line that failed.
STOPPED_REASONS = ("failed", "cancelled")
ENDED_STATES = ("completed", "failed", "cancelled", "billed")
# When each status was reached (a column of its own, as OpenAI's object gives it).
REACHED_AT = {
    "in_progress": "in_progress_at",
    "finalizing": "finalizing_at",
    "completed": "completed_at",
    "failed": "failed_at",
    "expired": "expired_at",
    "cancelling": "cancelling_at",
    "cancelled": "cancelled_at",
}


@dataclass(frozen=True, slots=True)
class NewBatch:
    tenant_id: str
    key_id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    window_seconds: int
    total: int
    metadata: Mapping[str, str] | None = None


@dataclass(frozen=True, slots=True)
class LineCounts:
    """A batch's lines so far, and the tokens its runs took."""

    submitted: int = 0
    ended: int = 0
    completed: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    output_tokens: int = 0


async def create_batch(db: Database, new: NewBatch) -> RowMapping:
    statement = (
        sa.insert(batches)
        .values(
            batch_id=f"batch_{uuid.uuid4().hex}",
            tenant_id=new.tenant_id,
            key_id=new.key_id,
            endpoint=new.endpoint,
            input_file_id=new.input_file_id,
            completion_window=new.completion_window,
            metadata=dict(new.metadata) if new.metadata is not None else None,
            status="validating",
            total=new.total,
            created_at=sa.func.now(),
            expires_at=sa.func.now() + sa.func.make_interval(0, 0, 0, 0, 0, 0, new.window_seconds),
        )
        .returning(*batches.c)
    )
    async with single_statement(db) as conn:
        return (await conn.execute(statement)).mappings().one()


async def find_batch(db: Database, tenant_id: str, batch_id: str) -> RowMapping | None:
    query = sa.select(batches).where(
        batches.c.batch_id == batch_id, batches.c.tenant_id == tenant_id
    )
    async with single_statement(db) as conn:
        return (await conn.execute(query)).mappings().first()


async def list_batches(
    db: Database, tenant_id: str, after: str | None, limit: int
) -> tuple[list[RowMapping], bool]:
    """A page of the tenant's batches, newest first."""
    query = sa.select(batches).where(batches.c.tenant_id == tenant_id)
    return await page(db, query, batches.c.created_at, batches.c.batch_id, after, limit)


async def open_batches(db: Database) -> list[RowMapping]:
    """Every batch a driver still has work on, oldest first."""
    query = (
        sa.select(batches)
        .where(batches.c.status.in_(OPEN_STATUSES))
        .order_by(batches.c.created_at, batches.c.batch_id)
    )
    async with single_statement(db) as conn:
        return list((await conn.execute(query)).mappings())


async def move(
    db: Database, batch_id: str, from_statuses: Collection[str], to: str, **values: Any
) -> RowMapping | None:
    """Moves the batch to `to` if it is in one of `from_statuses`; the row as it is now,
    or None when it was not (someone moved it first)."""
    changes: dict[str, Any] = {"status": to, **values}
    if to in REACHED_AT:
        changes[REACHED_AT[to]] = sa.func.now()
    statement = (
        sa.update(batches)
        .where(batches.c.batch_id == batch_id, batches.c.status.in_(list(from_statuses)))
        .values(**changes)
        .returning(*batches.c)
    )
    async with db.begin() as conn:
        return (await conn.execute(statement)).mappings().first()


async def record_line(
    db: Database, batch_id: str, line: int, run_id: str | None, error: Mapping[str, Any] | None
) -> None:
    """Names the line's run, or the error it was refused with; a line named already is
    kept as it was (its run is the same one: the line's idempotency key names it)."""
    statement = (
        insert(batch_lines)
        .values(batch_id=batch_id, line=line, run_id=run_id, error=error)
        .on_conflict_do_nothing(index_elements=["batch_id", "line"])
    )
    async with single_statement(db) as conn:
        await conn.execute(statement)


async def recorded_lines(db: Database, batch_id: str) -> dict[int, RowMapping]:
    """The batch's submitted lines by number: each one's run id and error."""
    query = sa.select(batch_lines).where(batch_lines.c.batch_id == batch_id)
    async with single_statement(db) as conn:
        return {row["line"]: row for row in (await conn.execute(query)).mappings()}


async def running_runs(db: Database, batch_id: str) -> list[str]:
    """The batch's runs that have not ended."""
    query = (
        sa.select(runs.c.run_id)
        .select_from(batch_lines.join(runs, runs.c.run_id == batch_lines.c.run_id))
        .where(batch_lines.c.batch_id == batch_id, runs.c.state.not_in(ENDED_STATES))
    )
    async with single_statement(db) as conn:
        return list((await conn.execute(query)).scalars())


async def line_counts(db: Database, batch_ids: Collection[str]) -> dict[str, LineCounts]:
    """Each batch's lines: submitted, ended (refused, or their runs ended), and of those
    completed and failed; and the tokens of all its runs so far."""
    ended = sa.or_(batch_lines.c.error.is_not(None), runs.c.state.in_(ENDED_STATES))
    stopped = sa.or_(batch_lines.c.error.is_not(None), runs.c.finish_reason.in_(STOPPED_REASONS))
    query = (
        sa.select(
            batch_lines.c.batch_id,
            sa.func.count(),
            sa.func.count().filter(ended),
            sa.func.count().filter(sa.and_(ended, sa.not_(stopped))),
            sa.func.count().filter(sa.and_(ended, stopped)),
            *(_tokens(name) for name in USAGE_NAMES),
        )
        .select_from(batch_lines.outerjoin(runs, runs.c.run_id == batch_lines.c.run_id))
        .where(batch_lines.c.batch_id.in_(list(batch_ids)))
        .group_by(batch_lines.c.batch_id)
    )
    async with single_statement(db) as conn:
        rows = (await conn.execute(query)).all()
    return {row[0]: LineCounts(*row[1:]) for row in rows}


def _tokens(name: str) -> sa.ColumnElement[int]:
    counted = sa.cast(runs.c.usage[name].astext, sa.BigInteger)
    return sa.func.coalesce(sa.func.sum(counted), 0)


async def finish(
    conn: AsyncConnection, batch_id: str, to: str, values: Mapping[str, Any]
) -> RowMapping | None:
    """In the transaction that wrote its output files: the batch moves from `finalizing`
    or `cancelling` to `to`."""
    changes: dict[str, Any] = {"status": to, REACHED_AT[to]: sa.func.now(), **values}
    statement = (
        sa.update(batches)
        .where(batches.c.batch_id == batch_id, batches.c.status.in_(["finalizing", "cancelling"]))
        .values(**changes)
        .returning(*batches.c)
    )
    return (await conn.execute(statement)).mappings().first()
