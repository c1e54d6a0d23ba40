"""Kafka consumers that stop fetching while no run event comes, woken by the next append.

A consumer of the run events asks the broker for records over and over, and an idle
embedded broker answers each empty fetch only once the consumer's wait is over: that
round trip, many times a second, was most of an idle stack's CPU. Once a consumer has
read nothing for `idle_after` seconds, `IdleFetch` has it listen for the event store's
notices (`EVENTS_CHANNEL`, sent by every append's commit), poll once more (what was
committed before the listener was on is on the topic by then, or its relay is about to
publish it), and then pause its partitions until a notice comes or `longest_sleep` has
passed; the consumer group's heartbeats go on meanwhile. A notice wakes it at the commit
of the run's first append, so it fetches as before well before that run's later events,
and it stops listening while it reads. A lost notice or listener costs at most
`longest_sleep`.
"""

from __future__ import annotations

import asyncio
import time

import psycopg
import structlog
from psycopg.conninfo import make_conninfo

from services.core.db import EVENTS_CHANNEL, KEEPALIVES, Database, Listener, libpq_url
from services.core.kafka_consumer import EventConsumer

log = structlog.get_logger(__name__)

IDLE_AFTER_S = 1.0
LONGEST_SLEEP_S = 5.0


class IdleFetch:
    """Pauses `consumer` while the store is quiet; call `after_poll` after each poll."""

    def __init__(
        self,
        db: Database,
        *,
        idle_after: float = IDLE_AFTER_S,
        longest_sleep: float = LONGEST_SLEEP_S,
    ) -> None:
        self.conninfo = make_conninfo(
            libpq_url(db.url.render_as_string(hide_password=False)), **KEEPALIVES
        )
        self.idle_after = idle_after
        self.longest_sleep = longest_sleep
        self._quiet_since = time.monotonic()
        self._num_read = 0
        # Kept open between idle spells, listening only during them.
        self._conn: psycopg.AsyncConnection | None = None
        self._listening = False
        # Set while the consumer is paused.
        self.asleep = asyncio.Event()
        # Spells of sleep so far, and whether one lasts (across its timed wake-ups).
        self._spells = 0
        self._in_spell = False

    @property
    def quiet_spell(self) -> int | None:
        """Names the spell of sleep going on (None while the consumer reads): nothing has
        been appended since it began, or its notice would have ended it."""
        return self._spells if self._in_spell else None

    async def after_poll(self, consumer: EventConsumer) -> None:
        """Returns at once while records come; once the consumer has been idle, when the
        next append commits (or `longest_sleep` has passed)."""
        read, self._num_read = consumer.num_read - self._num_read, consumer.num_read
        try:
            if read:
                self._quiet_since = time.monotonic()
                self._in_spell = False
                await self._unlisten()
            elif time.monotonic() - self._quiet_since < self.idle_after:
                return
            elif not self._listening:
                await self._listen()  # and poll once more before sleeping
            else:
                await self._sleep(consumer)
        except (psycopg.Error, OSError) as error:
            # Fetch as usual meanwhile; the next idle spell connects again.
            log.warning("idle listener lost", error=repr(error))
            self._quiet_since = time.monotonic()
            self._in_spell = False
            await self.aclose()

    async def _sleep(self, consumer: EventConsumer) -> None:
        assert self._conn is not None
        if not self._in_spell:
            self._spells, self._in_spell = self._spells + 1, True
        consumer.pause()
        self.asleep.set()
        try:
            notices = self._conn.notifies(timeout=self.longest_sleep, stop_after=1)
            woken = [notice async for notice in notices]
        finally:
            self.asleep.clear()
            consumer.resume()
        if woken:
            self._quiet_since = time.monotonic()
            self._in_spell = False
            await self._unlisten()

    async def _listen(self) -> None:
        if self._conn is None:
            self._conn = await Listener.connect(
                self.conninfo, autocommit=True, application_name="tollgate-idle-fetch"
            )
        await self._conn.execute(f"LISTEN {EVENTS_CHANNEL}")
        self._listening = True

    async def _unlisten(self) -> None:
        if self._conn is None or not self._listening:
            return
        self._listening = False
        await self._conn.execute(f"UNLISTEN {EVENTS_CHANNEL}")
        # Notices that came before the UNLISTEN would wake the next spell for nothing.
        async for _ in self._conn.notifies(timeout=0, stop_after=10_000):
            pass

    async def aclose(self) -> None:
        self._in_spell = False
        conn, self._conn, self._listening = self._conn, None, False
        if conn is not None:
            await conn.close()
