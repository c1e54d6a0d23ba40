"""When each API key was last used, kept without a write per call.

An authentication notes its key's use in memory; `flush` writes every key used since the
last flush in one statement, and `run` flushes every `interval` seconds. `last_used_at`
is therefore up to one interval late, and a process that dies loses at most that much.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime

import structlog

from services.core.db import Database, driver_cursor, single_statement
from services.core.loop import stop_if_cancelled

log = structlog.get_logger(__name__)

FLUSH_INTERVAL = 10.0

# Never moves a time back: another replica may have flushed a later use.
_FLUSH = """
    UPDATE api_keys SET last_used_at = greatest(api_keys.last_used_at, d.used_at)
    FROM unnest(%s::text[], %s::timestamptz[]) AS d(key_id, used_at)
    WHERE api_keys.key_id = d.key_id
"""


def _now() -> datetime:
    return datetime.now(UTC)


class KeyUsage:
    def __init__(self, clock: Callable[[], datetime] = _now) -> None:
        self.clock = clock
        self._pending: dict[str, datetime] = {}

    def used(self, key_id: str) -> None:
        self._pending[key_id] = self.clock()

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    async def flush(self, db: Database) -> int:
        """Writes the keys used since the last flush, in one statement; returns how many.
        On failure they are kept for the next flush."""
        pending, self._pending = self._pending, {}
        if not pending:
            return 0
        try:
            async with single_statement(db) as conn, driver_cursor(conn) as cursor:
                await cursor.execute(_FLUSH, (list(pending), list(pending.values())))
        except BaseException:
            for key_id, used_at in pending.items():
                self._pending[key_id] = max(used_at, self._pending.get(key_id, used_at))
            raise
        return len(pending)

    async def run(self, db: Database, interval: float = FLUSH_INTERVAL) -> None:
        """Flushes every `interval` seconds until cancelled."""
        while True:
            await asyncio.sleep(interval)
            stop_if_cancelled()
            await self.flush_logged(db)

    async def flush_logged(self, db: Database) -> None:
        """`flush`, with a failure logged rather than raised."""
        try:
            await self.flush(db)
        except Exception as error:  # the database away: the next flush writes them
            log.warning("key usage not written", error=repr(error), num_keys=self.num_pending)
