"""A single-statement connection commits each statement, and goes back to the pool
ready for transactions again."""

import asyncio

import pytest
import sqlalchemy as sa

from services.core.db import open_db, single_statement


async def test_single_statements_commit_at_once_and_leave_the_pool_transactional(
    database_url: str,
) -> None:
    db = open_db(database_url, pool_size=1)  # one connection: both blocks share it
    try:
        async with db.begin() as conn:
            await conn.execute(sa.text("CREATE TABLE t (x int)"))
        with pytest.raises(RuntimeError):
            async with single_statement(db) as conn:
                await conn.execute(sa.text("INSERT INTO t VALUES (1)"))
                raise RuntimeError("after the statement")
        with pytest.raises(RuntimeError):
            async with db.begin() as conn:
                await conn.execute(sa.text("INSERT INTO t VALUES (2)"))
                raise RuntimeError("inside the transaction")
        async with db.connect() as conn:
            assert (await conn.scalars(sa.text("SELECT x FROM t"))).all() == [1]
    finally:
        await db.dispose()


async def test_the_pool_keeps_every_connection_it_opened_and_opens_no_more(
    database_url: str,
) -> None:
    db = open_db(database_url, pool_size=3)
    try:
        held = [await db.connect() for _ in range(3)]
        for conn in held:
            await conn.execute(sa.text("SELECT 1"))
        # A fourth waits for one of the three instead of opening another.
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(db.connect(), 0.5)
        backends = {(await c.scalar(sa.text("SELECT pg_backend_pid()"))) for c in held}
        for conn in held:
            await conn.close()
        assert db.pool.checkedin() == 3  # returned, not closed
        again = [await db.connect() for _ in range(3)]
        assert {(await c.scalar(sa.text("SELECT pg_backend_pid()"))) for c in again} == backends
        for conn in again:
            await conn.close()
    finally:
        await db.dispose()
