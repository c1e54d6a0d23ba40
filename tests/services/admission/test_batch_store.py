"""Files and batches in PostgreSQL: a file kept whole or not at all and read back chunk by
chunk and line by line; pages of a tenant's own files and batches; a file a running batch
reads kept from deletion; a batch moved by one driver only; its counts read from its
lines' runs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import sqlalchemy as sa

from services.admission.batch_store import (
    NewBatch,
    create_batch,
    find_batch,
    line_counts,
    list_batches,
    move,
    open_batches,
    record_line,
    recorded_lines,
    running_runs,
)
from services.admission.file_store import (
    NewFile,
    delete_file,
    find_file,
    list_files,
    read_chunks,
    read_lines,
    write_chunks,
    write_file,
)
from services.core.db import Database, open_db
from services.core.errors import FailedPrecondition
from services.core.schema import runs


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[Database]:
    db = open_db(database_url, pool_size=4)
    yield db
    await db.dispose()


async def kept(db: Database, tenant_id: str, chunks: list[bytes], **fields: Any) -> str:
    new = NewFile(tenant_id, "batch", "in.jsonl", **fields).with_id()
    async with db.begin() as conn:
        size = await write_chunks(conn, new.file_id, chunks)
        await write_file(conn, new, size)
    return new.file_id


async def collected(items: AsyncIterator[bytes]) -> list[bytes]:
    return [item async for item in items]


async def test_a_file_is_read_back_as_written(db: Database) -> None:
    chunks = [b'{"a": 1}\n{"b"', b": 2}\n\n", b'{"c": 3}']
    file_id = await kept(db, "t1", chunks, lines=3, endpoints=["/v1/completions"])
    row = await find_file(db, "t1", file_id)
    assert row is not None and row["bytes"] == sum(map(len, chunks)) and row["lines"] == 3
    assert row["endpoints"] == ["/v1/completions"]
    assert await collected(read_chunks(db, file_id)) == chunks
    assert await collected(read_lines(db, file_id)) == [b'{"a": 1}', b'{"b": 2}', b'{"c": 3}']
    assert await find_file(db, "t2", file_id) is None


async def test_a_file_whose_transaction_fails_leaves_nothing(db: Database) -> None:
    new = NewFile("t1", "batch", "x.jsonl").with_id()
    with pytest.raises(RuntimeError):
        async with db.begin() as conn:
            await write_chunks(conn, new.file_id, [b"x"])
            raise RuntimeError("the upload was refused")
    assert await collected(read_chunks(db, new.file_id)) == []


async def test_files_are_paged_newest_first_and_by_purpose(db: Database) -> None:
    ids = [await kept(db, "pager", [b"x"]) for _ in range(5)]
    first, more = await list_files(db, "pager", None, None, 2, "desc")
    assert [r["file_id"] for r in first] == ids[::-1][:2] and more
    rest, more = await list_files(db, "pager", None, first[-1]["file_id"], 10, "desc")
    assert [r["file_id"] for r in rest] == ids[::-1][2:] and not more
    oldest, _ = await list_files(db, "pager", None, None, 1, "asc")
    assert oldest[0]["file_id"] == ids[0]
    assert (await list_files(db, "pager", "batch_output", None, 10, "desc"))[0] == []
    assert (await list_files(db, "other", None, None, 10, "desc"))[0] == []


async def batch_of(db: Database, tenant_id: str, file_id: str, total: int = 3) -> str:
    new = NewBatch(tenant_id, "key1", "/v1/completions", file_id, "24h", 86400, total)
    row = await create_batch(db, new)
    assert row["status"] == "validating" and row["expires_at"] > row["created_at"]
    return str(row["batch_id"])


async def test_a_file_a_running_batch_reads_is_kept(db: Database) -> None:
    file_id = await kept(db, "t1", [b"x"])
    batch_id = await batch_of(db, "t1", file_id)
    with pytest.raises(FailedPrecondition, match=batch_id):
        await delete_file(db, "t1", file_id)
    assert await find_file(db, "t1", file_id) is not None
    assert await move(db, batch_id, ["validating"], "failed") is not None
    await delete_file(db, "t1", file_id)
    assert await find_file(db, "t1", file_id) is None
    assert await collected(read_chunks(db, file_id)) == []


async def test_only_one_driver_moves_a_batch(db: Database) -> None:
    batch_id = await batch_of(db, "t1", await kept(db, "t1", [b"x"]))
    moved = await asyncio.gather(
        *(move(db, batch_id, ["validating"], "in_progress") for _ in range(4))
    )
    winners = [row for row in moved if row is not None]
    assert len(winners) == 1 and winners[0]["in_progress_at"] is not None
    assert batch_id in [row["batch_id"] for row in await open_batches(db)]
    assert await move(db, batch_id, ["validating"], "cancelling") is None
    found = await find_batch(db, "t1", batch_id)
    assert found is not None and found["status"] == "in_progress"
    assert await find_batch(db, "t2", batch_id) is None
    page, _ = await list_batches(db, "t1", None, 100)
    assert batch_id in [row["batch_id"] for row in page]


async def a_run(db: Database, run_id: str, state: str, finish: str | None) -> None:
    usage = {"prompt_tokens": 5, "cached_prompt_tokens": 1, "output_tokens": 2}
    async with db.begin() as conn:
        await conn.execute(
            sa.insert(runs).values(
                run_id=run_id,
                tenant_id="t1",
                model="m",
                priority="batch",
                state=state,
                last_seq=1,
                lease_epoch=0,
                finish_reason=finish,
                usage=usage,
                created_at=sa.func.now(),
                updated_at=sa.func.now(),
            )
        )


async def test_counts_are_read_from_the_lines_runs(db: Database) -> None:
    batch_id = await batch_of(db, "t1", await kept(db, "t1", [b"x"]), total=5)
    prefix = batch_id.removeprefix("batch_")
    for n, (state, finish) in enumerate(
        [("billed", "stop"), ("completed", "length"), ("billed", "failed"), ("streaming", None)]
    ):
        await a_run(db, f"run_{prefix}_{n}", state, finish)
        await record_line(db, batch_id, n + 1, f"run_{prefix}_{n}", None)
    await record_line(db, batch_id, 5, None, {"status_code": 400, "body": {}})
    # Recorded again (a new leader going over the same line): kept as it was.
    await record_line(db, batch_id, 1, "run_other", None)
    counts = (await line_counts(db, [batch_id]))[batch_id]
    assert (counts.submitted, counts.ended, counts.completed, counts.failed) == (5, 4, 2, 2)
    assert (counts.prompt_tokens, counts.cached_prompt_tokens, counts.output_tokens) == (20, 4, 8)
    assert await running_runs(db, batch_id) == [f"run_{prefix}_3"]
    lines = await recorded_lines(db, batch_id)
    assert lines[1]["run_id"] == f"run_{prefix}_0" and lines[5]["error"]["status_code"] == 400
    assert lines[2]["error"] is None
