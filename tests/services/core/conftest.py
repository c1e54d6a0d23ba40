from collections.abc import AsyncIterator

import pytest

from services.core.db import Database, open_db
from services.core.event_store import EventStore


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[Database]:
    db = open_db(database_url, pool_size=20)
    yield db
    await db.dispose()


@pytest.fixture
def store(db: Database) -> EventStore:
    return EventStore(db)
