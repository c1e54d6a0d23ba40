"""Sends runs' live pieces to the streams attached to them, through PostgreSQL's notices.

One statement carries every piece that piled up while the last was on its way, over a
connection of its own. Best effort by design: a piece that is lost (the database was
away, the notice too long) leaves a gap its streams fill from the run's next stored
event (`services.core.live`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import psycopg
import structlog
from psycopg.conninfo import make_conninfo

from services.core.db import KEEPALIVES, libpq_url
from services.core.live import LIVE_CHANNEL, live_notice

log = structlog.get_logger(__name__)

# Pieces held while a statement is on its way; beyond, the oldest are dropped.
MAX_WAITING = 4096
_NOTIFY = "SELECT pg_notify(%s, notice) FROM unnest(%s::text[]) AS notice"


class LivePublisher:
    def __init__(self, database_url: str, *, retry_interval: float = 1.0) -> None:
        self.conninfo = make_conninfo(libpq_url(database_url), **KEEPALIVES)
        self.retry_interval = retry_interval
        self.connected = False
        self._waiting: list[str] = []
        self._ready = asyncio.Event()

    def publish(self, run_id: str, tenant_id: str, pieces: Sequence[Mapping[str, Any]]) -> None:
        """Queues a run's pieces for the next statement; dropped while not connected."""
        notice = live_notice(run_id, tenant_id, pieces) if self.connected else None
        if notice is None:
            return
        self._waiting.append(notice)
        if len(self._waiting) > MAX_WAITING:
            del self._waiting[: len(self._waiting) - MAX_WAITING]
        self._ready.set()

    async def run(self) -> None:
        """Sends what is queued until cancelled, reconnecting after database trouble."""
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(
                    self.conninfo, autocommit=True
                ) as conn:
                    self.connected = True
                    while True:
                        await self._ready.wait()
                        self._ready.clear()
                        notices, self._waiting = self._waiting, []
                        await conn.execute(_NOTIFY, (LIVE_CHANNEL, notices))
            except Exception as error:
                log.warning("live pieces interrupted", error=repr(error))
            self.connected = False
            self._waiting.clear()
            await asyncio.sleep(self.retry_interval)
