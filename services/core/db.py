"""The database handle: one pool of connections per process, called `db` everywhere."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import psycopg
from psycopg import AsyncCursor
from psycopg.abc import PQGen
from psycopg.rows import dict_row
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

RV = TypeVar("RV")

# Notified in the transaction that appends events; delivered when it commits.
EVENTS_CHANNEL = "tollgate_run_events"
# Notified in the transaction that records an admin event, to wake the outbox relay.
ADMIN_EVENTS_CHANNEL = "tollgate_admin_events"

# For a connection that waits for the server (a LISTEN, a lock): one gone half-open would
# otherwise wait forever; TCP keepalives find it within a minute.
KEEPALIVES = {
    "keepalives": 1,
    "keepalives_idle": 30,
    "keepalives_interval": 10,
    "keepalives_count": 3,
}

# How often a coroutine waiting on a `Listener` wakes to look at its socket again, though
# nothing came: psycopg's default, 0.1 s, is for a blocking wait's Ctrl-C, which asyncio
# needs no wake-up for (data, a timeout or a cancellation end the wait at once).
LISTENER_WAKE_S = 5.0


class Listener(psycopg.AsyncConnection[Any]):
    """A connection that waits long on the server (a LISTEN, a lock) and costs nothing
    meanwhile. Open it with `Listener.connect` as any psycopg connection."""

    async def wait(
        self, gen: PQGen[RV], interval: float = LISTENER_WAKE_S, timeout: float | None = None
    ) -> RV:
        return await super().wait(gen, interval=max(interval, LISTENER_WAKE_S), timeout=timeout)


# SQLAlchemy names its pool an engine; here the engine is the model's.
Database = AsyncEngine


def sqlalchemy_url(url: str) -> str:
    """Accepts libpq-style `postgresql://` URLs and selects the psycopg 3 driver."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed.render_as_string(hide_password=False)


def libpq_url(url: str) -> str:
    """The same database as a plain libpq URL, for psycopg connections."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def open_db(url: str, *, pool_size: int = 20) -> Database:
    """The process's pool of at most `pool_size` connections, each opened on first use and
    then kept: a connection opened past the pool's size and closed once returned (the
    overflow) would cost a PostgreSQL backend start for every burst of work."""
    return create_async_engine(
        sqlalchemy_url(url), pool_size=pool_size, max_overflow=0, pool_pre_ping=False
    )


@contextlib.asynccontextmanager
async def single_statement(db: Database) -> AsyncIterator[AsyncConnection]:
    """A pooled connection for one statement, which is then its own transaction: one
    round trip instead of three (BEGIN, the statement, COMMIT or ROLLBACK).

    Only for a single statement: two would each see their own snapshot and commit apart.
    """
    async with db.connect() as conn:
        yield await conn.execution_options(isolation_level="AUTOCOMMIT")


@contextlib.asynccontextmanager
async def driver_cursor(conn: AsyncConnection) -> AsyncIterator[AsyncCursor[dict[str, Any]]]:
    """A psycopg cursor on `conn`'s own connection, inside its transaction, rows as dicts.

    For the statements every run goes through: plain SQL sent by the driver costs about
    a third of the CPU of SQLAlchemy's statement path.
    """
    driver = (await conn.get_raw_connection()).driver_connection
    assert driver is not None
    async with driver.cursor(row_factory=dict_row) as cursor:
        yield cursor
