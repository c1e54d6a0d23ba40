"""A database of its own for each migration test, migrated up to the revision it asks for."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest

from services.core import migrate
from services.stack.infra import Endpoints, create_database, drop_database


@pytest.fixture
def database_at(infra: Endpoints) -> Iterator[Callable[[str], str]]:
    """Creates a database migrated up to `revision`; returns its URL. Dropped afterwards."""
    names: list[str] = []

    def create(revision: str) -> str:
        names.append(f"test_{uuid.uuid4().hex}")
        url = create_database(infra.database_url, names[-1])
        migrate.upgrade(url, revision)
        return url

    yield create
    for name in names:
        drop_database(infra.database_url, name)
