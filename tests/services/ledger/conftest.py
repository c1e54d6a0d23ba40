from collections.abc import AsyncIterator

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from services.core.db import create_engine
from services.core.eventstore import EventStore
from services.ledger.pricing import PriceTable


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_engine(database_url, pool_size=20)
    yield engine
    await engine.dispose()


@pytest.fixture
def store(engine: AsyncEngine) -> EventStore:
    return EventStore(engine)


@pytest.fixture
def prices() -> PriceTable:
    return PriceTable({"*": {"input_tokens": 2, "cached_input_tokens": 1, "output_tokens": 8}})
