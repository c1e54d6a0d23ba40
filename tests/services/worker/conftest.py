from collections.abc import AsyncIterator

import pytest

from services.core.db import open_db
from services.core.event_store import EventStore


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[EventStore]:
    db = open_db(database_url)
    yield EventStore(db)
    await db.dispose()
