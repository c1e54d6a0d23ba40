"""A single-statement connection commits each statement, and goes back to the pool
ready for transactions again."""

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
