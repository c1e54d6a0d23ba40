"""One leader among replicas: the holder of a PostgreSQL session advisory lock.

The lock lives as long as the session that took it.  When the leader's process dies
its connection closes, PostgreSQL releases the lock, and the server hands it at once to
a waiting replica, whose request for it waits in the server (no polling).  The session
asks the server to notice a silent peer (keepalives, a TCP user timeout), so a leader
cut off by the network loses the lock too, after about `SESSION_TIMEOUT_S`.

A leader that loses its own session stops leading at once, not when the server notices:
with `check_interval` set, the session is checked that often and the leader's work is
cancelled on the first check that fails or takes longer than `check_timeout`.  Work that
runs its queries on the lock's own connection (the outbox relay) needs no check: its
next query fails instead.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import psycopg
import structlog
from psycopg.conninfo import make_conninfo

from services.core.db import KEEPALIVES, Database, Listener, libpq_url
from services.core.loop import stop_if_cancelled, within

log = structlog.get_logger(__name__)

# What the leader does while it leads; given the lock's connection, cancelled when it ends.
Lead = Callable[[psycopg.AsyncConnection], Awaitable[None]]

# How long the server waits on a silent leader's session before it ends it.
SESSION_TIMEOUT_S = 6
# How long a replica waits in the server for the lock before it asks again: its session
# may have ended without its knowing (the server ends silent sessions).
LOCK_WAIT_S = 30.0
_BOUND_SESSION = (
    "SET tcp_keepalives_idle = 2",
    "SET tcp_keepalives_interval = 1",
    "SET tcp_keepalives_count = 3",
    f"SET tcp_user_timeout = {SESSION_TIMEOUT_S * 1000}",
)


class Leadership:
    """Competes for the advisory lock `lock_key`; runs `lead` while it holds it."""

    def __init__(
        self,
        db: Database,
        lock_key: int,
        *,
        name: str,
        takeover_interval: float = 0.5,
        check_interval: float | None = None,
        check_timeout: float = 2.0,
    ) -> None:
        self.conninfo = make_conninfo(
            libpq_url(db.url.render_as_string(hide_password=False)), **KEEPALIVES
        )
        self.lock_key = lock_key
        self.name = name
        self.takeover_interval = takeover_interval
        self.check_interval = check_interval
        self.check_timeout = check_timeout
        # Set while this replica leads.
        self.is_leader = asyncio.Event()
        # Set once the first attempt at the lock has been decided, either way.
        self.decided = asyncio.Event()

    async def run(self, lead: Lead) -> None:
        """Waits for the lock, leads, and competes again whenever leading ends; until
        cancelled."""
        while True:
            stop_if_cancelled()
            try:
                async with await Listener.connect(
                    self.conninfo, autocommit=True, application_name=f"tollgate-{self.name}"
                ) as conn:
                    await _bound_session(conn)
                    await self._wait_for_lock(conn)
                    await self._hold(conn, lead)
            except Exception as exc:  # database trouble: back off, compete again
                log.warning("stopped leading", lock=self.name, error=str(exc) or repr(exc))
            finally:
                self.is_leader.clear()
            await asyncio.sleep(self.takeover_interval)

    async def _wait_for_lock(self, conn: psycopg.AsyncConnection) -> None:
        while True:
            cursor = await conn.execute("SELECT pg_try_advisory_lock(%s)", (self.lock_key,))
            row = await cursor.fetchone()
            self.decided.set()
            if row and row[0]:
                return
            # Granted the moment the holder's session ends. A wait cut short is cancelled
            # in the server too; one granted as it was cut short leaves the lock held, and
            # the next try takes it again (a session may hold it several times).
            with contextlib.suppress(TimeoutError):
                await within(
                    conn.execute("SELECT pg_advisory_lock(%s)", (self.lock_key,)), LOCK_WAIT_S
                )
                return

    async def _hold(self, conn: psycopg.AsyncConnection, lead: Lead) -> None:
        log.info("leading", lock=self.name)
        self.is_leader.set()
        if self.check_interval is None:
            await lead(conn)
            return
        tasks = [asyncio.ensure_future(lead(conn)), asyncio.ensure_future(self._check(conn))]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Cleared before the work is cancelled: nothing may count on leading meanwhile.
            self.is_leader.clear()
            for task in tasks:
                task.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
        for result in results:
            if isinstance(result, Exception):
                raise result  # what ended leading

    async def _check(self, conn: psycopg.AsyncConnection) -> None:
        assert self.check_interval is not None
        while True:
            await asyncio.sleep(self.check_interval)
            await within(conn.execute("SELECT 1"), self.check_timeout)


async def _bound_session(conn: psycopg.AsyncConnection) -> None:
    for statement in _BOUND_SESSION:
        try:
            await conn.execute(statement)
        except psycopg.Error as exc:  # an older server: fewer bounds, still correct
            log.debug("session bound not set", statement=statement, error=str(exc))
