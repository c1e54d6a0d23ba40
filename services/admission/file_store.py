"""Files of the Batch API in PostgreSQL: a `files` row each, its bytes in `file_chunks`
(`bytea` rows of at most `CHUNK_BYTES`, in order).

A file is kept whole or not at all: its chunks and its row are written in one
transaction, so an upload cut short, or refused once read, leaves nothing behind. A
deleted file's row stays, marked, so its id is never reused; its chunks go.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import RowMapping
from sqlalchemy.ext.asyncio import AsyncConnection

from services.core.db import Database, single_statement
from services.core.errors import FailedPrecondition
from services.core.schema import batches, file_chunks, files

OPEN_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")


@dataclass(frozen=True, slots=True)
class NewFile:
    tenant_id: str
    purpose: str
    filename: str
    # The lines that are requests, and the endpoints they name (a batch input's).
    lines: int = 0
    endpoints: Sequence[str] = ()
    file_id: str = ""

    def with_id(self) -> NewFile:
        return self if self.file_id else _replace_id(self, f"file-{uuid.uuid4().hex}")


def _replace_id(new: NewFile, file_id: str) -> NewFile:
    return NewFile(new.tenant_id, new.purpose, new.filename, new.lines, new.endpoints, file_id)


async def write_chunks(conn: AsyncConnection, file_id: str, chunks: Iterable[bytes]) -> int:
    """Writes `chunks` as the file's bytes, in order; returns how many bytes."""
    size = 0
    for number, data in enumerate(chunks):
        await write_chunk(conn, file_id, number, data)
        size += len(data)
    return size


async def write_chunk(conn: AsyncConnection, file_id: str, number: int, data: bytes) -> None:
    await conn.execute(sa.insert(file_chunks).values(file_id=file_id, chunk=number, data=data))


async def write_file(conn: AsyncConnection, new: NewFile, size: int) -> RowMapping:
    """The file's row, in the transaction that wrote its chunks; returns it."""
    statement = (
        sa.insert(files)
        .values(
            file_id=new.file_id,
            tenant_id=new.tenant_id,
            purpose=new.purpose,
            filename=new.filename,
            bytes=size,
            lines=new.lines,
            endpoints=sorted(new.endpoints),
            created_at=sa.func.now(),
        )
        .returning(*files.c)
    )
    return (await conn.execute(statement)).mappings().one()


async def find_file(db: Database, tenant_id: str, file_id: str) -> RowMapping | None:
    """The tenant's file, unless it was deleted."""
    query = sa.select(files).where(
        files.c.file_id == file_id, files.c.tenant_id == tenant_id, files.c.deleted_at.is_(None)
    )
    async with single_statement(db) as conn:
        return (await conn.execute(query)).mappings().first()


async def read_chunks(db: Database, file_id: str) -> AsyncIterator[bytes]:
    """The file's bytes, a chunk at a time (one query each: a large file is never held
    whole)."""
    number = 0
    while True:
        query = sa.select(file_chunks.c.data).where(
            file_chunks.c.file_id == file_id, file_chunks.c.chunk == number
        )
        async with single_statement(db) as conn:
            data = (await conn.execute(query)).scalar()
        if data is None:
            return
        yield bytes(data)
        number += 1


async def read_lines(db: Database, file_id: str) -> AsyncIterator[bytes]:
    """The file's lines that are not blank, in order, without their newlines."""
    partial = b""
    async for chunk in read_chunks(db, file_id):
        *whole, partial = (partial + chunk).split(b"\n")
        for line in whole:
            if line.strip():
                yield line
    if partial.strip():
        yield partial


async def list_files(
    db: Database, tenant_id: str, purpose: str | None, after: str | None, limit: int, order: str
) -> tuple[list[RowMapping], bool]:
    """A page of the tenant's files, newest first unless `order` is `asc`, after the file
    `after`; and whether more follow."""
    query = sa.select(files).where(files.c.tenant_id == tenant_id, files.c.deleted_at.is_(None))
    if purpose is not None:
        query = query.where(files.c.purpose == purpose)
    return await page(db, query, files.c.created_at, files.c.file_id, after, limit, order)


async def page(
    db: Database,
    query: sa.Select[Any],
    created_at: sa.ColumnElement[Any],
    row_id: sa.ColumnElement[Any],
    after: str | None,
    limit: int,
    order: str = "desc",
) -> tuple[list[RowMapping], bool]:
    """A keyset page of `query`'s rows ordered by (`created_at`, `row_id`), after the row
    whose id is `after` (none, or one not in `query`: from the first); and whether more
    follow."""
    ascending = order == "asc"
    async with single_statement(db) as conn:
        if after is not None:
            marks = query.with_only_columns(created_at).where(row_id == after)
            mark = (await conn.execute(marks)).scalar()
            if mark is not None:
                if ascending:
                    beyond = sa.or_(created_at > mark, sa.and_(created_at == mark, row_id > after))
                else:
                    beyond = sa.or_(created_at < mark, sa.and_(created_at == mark, row_id < after))
                query = query.where(beyond)
        columns = (created_at, row_id)
        ordering = [c.asc() if ascending else c.desc() for c in columns]
        rows = list((await conn.execute(query.order_by(*ordering).limit(limit + 1))).mappings())
    return rows[:limit], len(rows) > limit


async def delete_file(db: Database, tenant_id: str, file_id: str) -> None:
    """Deletes the tenant's file, unless a batch still running reads it (then raises
    FailedPrecondition: its lines are still needed)."""
    async with db.begin() as conn:
        reader = (
            await conn.execute(
                sa.select(batches.c.batch_id).where(
                    batches.c.input_file_id == file_id, batches.c.status.in_(OPEN_STATUSES)
                )
            )
        ).scalar()
        if reader is not None:
            raise FailedPrecondition(
                f"the file is the input of batch {reader}, which is still running: cancel the"
                " batch, or wait for it to end",
                "FILE_IN_USE",
            )
        await conn.execute(
            sa.update(files)
            .where(files.c.file_id == file_id, files.c.tenant_id == tenant_id)
            .values(deleted_at=sa.func.coalesce(files.c.deleted_at, sa.func.now()))
        )
        await conn.execute(sa.delete(file_chunks).where(file_chunks.c.file_id == file_id))
