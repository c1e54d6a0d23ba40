from collections.abc import AsyncIterator

import pytest

from services.core.db import Database, open_db
from services.core.event_store import EventStore
from services.core.pricing import PriceTable


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[Database]:
    db = open_db(database_url, pool_size=20)
    yield db
    await db.dispose()


@pytest.fixture
def store(db: Database) -> EventStore:
    return EventStore(db)


@pytest.fixture
def prices() -> PriceTable:
    return PriceTable({"*": {"input_tokens": 2, "cached_input_tokens": 1, "output_tokens": 8}})
