from collections.abc import AsyncIterator

import pytest

from services.core.db import create_engine
from services.core.eventstore import EventStore


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[EventStore]:
    engine = create_engine(database_url)
    yield EventStore(engine)
    await engine.dispose()
