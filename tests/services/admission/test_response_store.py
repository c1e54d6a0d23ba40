"""A response's row: kept once, read by its tenant only, gone when deleted or past the
retention."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from services.admission.response_store import (
    ResponseRecord,
    delete_response,
    find_response,
    save_response,
)
from services.core.db import Database, open_db

WEEK = 7 * 24 * 3600.0
RECORD = ResponseRecord(
    "run_abc",
    "t1",
    {"store": True, "metadata": {"k": "v"}},
    [{"id": "msg_abc_in0", "type": "message", "role": "user", "content": []}],
    [{"role": "user", "content": "hi\u0000", "tool_calls": [], "tool_call_id": ""}],
)


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[Database]:
    db = open_db(database_url, pool_size=2)
    yield db
    await db.dispose()


async def test_a_response_is_kept_once_and_read_by_its_tenant(db: Database) -> None:
    await save_response(db, RECORD)
    await save_response(db, ResponseRecord("run_abc", "t1", {"store": False}))
    found = await find_response(db, "t1", "run_abc", WEEK)
    assert found is not None and found.created_at is not None
    assert (found.request, found.input_items, found.conversation) == (
        RECORD.request,
        RECORD.input_items,
        RECORD.conversation,
    )
    assert found.stored and not found.background
    assert await find_response(db, "t2", "run_abc", WEEK) is None
    await delete_response(db, "t2", "run_abc")
    assert await find_response(db, "t1", "run_abc", WEEK) is not None


async def test_deleted_and_expired_responses_are_gone(db: Database) -> None:
    await save_response(db, RECORD)
    await asyncio.sleep(0.2)
    assert await find_response(db, "t1", "run_abc", 0.1) is None
    await delete_response(db, "t1", "run_abc")
    assert await find_response(db, "t1", "run_abc", WEEK) is None
