from collections.abc import AsyncIterator

import pytest

from tests.tollgate.fake_gateway import FakeServer, start_fake


@pytest.fixture
async def fake() -> AsyncIterator[FakeServer]:
    """A fresh fake Gateway/Admin/Ledger server on a free loopback port."""
    server = await start_fake()
    yield server
    await server.server.stop(0)
