from collections.abc import AsyncIterator

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from services.core.db import create_engine
from services.core.eventstore import EventStore


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_engine(database_url, pool_size=20)
    yield engine
    await engine.dispose()


@pytest.fixture
def store(engine: AsyncEngine) -> EventStore:
    return EventStore(engine)
