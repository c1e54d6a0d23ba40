"""Transactional outbox relay: committed run events → Kafka.

One relay publishes at a time across all processes: the holder of a PostgreSQL
session advisory lock.  When its process dies the session ends, the lock is
released, and a waiting relay takes over within `takeover_interval`.

The outbox holds only unpublished rows, so an event whose transaction commits
late is still there when it becomes visible and is published then; nothing
depends on commit order matching id order.  Per-run order holds because the
appends of one run serialize on its projection row, so a run's outbox ids
increase in commit order, and the relay publishes in id order, keyed by run_id.
Delivery is at least once: a crash after the broker's ack and before the
delete publishes the batch again, and consumers dedupe by (run_id, seq).

An event the producer, the broker or the encoder refuses for itself (too large, not
encodable) would be refused again on every pass, and hold up every event behind it:
once refused `max_attempts` times it is set aside in `dead_letters`, counted and
logged, and the relay goes on. The other events of its batch go out meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence

import psycopg
import structlog
from prometheus_client import Counter
from psycopg.rows import dict_row

from services.core.config import RUN_EVENTS_TOPIC
from services.core.db import EVENTS_CHANNEL, Database, libpq_url
from services.core.eventstore import event_from_row
from services.core.kafka import Publisher, Refused
from services.core.runs import StoredEvent

log = structlog.get_logger(__name__)


# Arbitrary constant naming the relay's advisory lock.
RELAY_LOCK_KEY = 0x746F6C6C  # "toll"

PUBLISHED = Counter("tollgate_relay_events_published", "Run events the relay published to Kafka")
DEAD_LETTERED = Counter(
    "tollgate_relay_events_dead_lettered", "Run events the relay set aside in dead_letters"
)
# Passes that may refuse an event before it is set aside.
MAX_PUBLISH_ATTEMPTS = 3


class Refusals:
    """How often each outbox row was refused, until it is set aside (no I/O)."""

    def __init__(self, max_attempts: int = MAX_PUBLISH_ATTEMPTS) -> None:
        self.max_attempts = max_attempts
        self._counts: dict[int, int] = {}

    def refused(self, outbox_id: int) -> bool:
        """Counts one refusal; True once the row is to be set aside (and forgotten here)."""
        count = self._counts[outbox_id] = self._counts.get(outbox_id, 0) + 1
        if count < self.max_attempts:
            return False
        del self._counts[outbox_id]
        return True

    def forget(self, outbox_ids: Iterable[int]) -> None:
        for outbox_id in outbox_ids:
            self._counts.pop(outbox_id, None)


class OutboxRelay:
    def __init__(
        self,
        db: Database,
        bootstrap: str,
        *,
        topic: str = RUN_EVENTS_TOPIC,
        batch_size: int = 500,
        poll_interval: float = 1.0,
        takeover_interval: float = 0.5,
        lock_key: int = RELAY_LOCK_KEY,
        max_attempts: int = MAX_PUBLISH_ATTEMPTS,
    ) -> None:
        self.db = db
        self.bootstrap = bootstrap
        self.topic = topic
        self.batch_size = batch_size
        self.poll_interval = poll_interval
        self.takeover_interval = takeover_interval
        self.lock_key = lock_key
        self.is_leader = asyncio.Event()
        self.refusals = Refusals(max_attempts)

    async def run(self) -> None:
        """Waits for the relay lock, then publishes until cancelled."""
        conninfo = libpq_url(self.db.url.render_as_string(hide_password=False))
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(conninfo, autocommit=True) as conn:
                    await self._wait_for_lock(conn)
                    await self._lead(conn)
            except Exception as exc:  # database or broker trouble: back off, compete again
                log.warning("relay stopped leading", error=str(exc))
                self.is_leader.clear()
                await asyncio.sleep(self.takeover_interval)

    async def _wait_for_lock(self, conn: psycopg.AsyncConnection) -> None:
        while True:
            cursor = await conn.execute("SELECT pg_try_advisory_lock(%s)", (self.lock_key,))
            row = await cursor.fetchone()
            if row and row[0]:
                return
            await asyncio.sleep(self.takeover_interval)

    async def _lead(self, conn: psycopg.AsyncConnection) -> None:
        await conn.execute(f"LISTEN {EVENTS_CHANNEL}")
        async with Publisher(self.bootstrap, self.topic) as publisher:
            log.info("relay leading", topic=self.topic)
            self.is_leader.set()
            try:
                while True:
                    if await self.publish_once(conn, publisher) < self.batch_size:
                        await self._wait_for_notify(conn)
            finally:
                self.is_leader.clear()

    async def _wait_for_notify(self, conn: psycopg.AsyncConnection) -> None:
        # Wakes on the first commit that appended events, or after
        # poll_interval as a safety net; both lead to a fresh query.
        async for _ in conn.notifies(timeout=self.poll_interval, stop_after=1):
            pass
        # Notifications that arrived meanwhile are all covered by the next query.
        async for _ in conn.notifies(timeout=0, stop_after=10_000):
            pass

    async def publish_once(self, conn: psycopg.AsyncConnection, publisher: Publisher) -> int:
        """Publishes one batch of unpublished events; returns how many.

        The queries run on the relay's own connection, the one that holds the lock
        and listens: notices that arrive meanwhile wait for the next `notifies()`.
        """
        ids, events = await self._fetch_batch(conn)
        if not events:
            return 0
        # Deleted only once the broker has them all: a crash in between publishes them again.
        refused = await publisher.publish(events)
        outbox_ids = {(e.run_id, e.seq): i for i, e in zip(ids, events, strict=True)}
        refused_by_id = {outbox_ids[r.event.run_id, r.event.seq]: r for r in refused}
        published = [i for i in ids if i not in refused_by_id]
        await self.mark_published(conn, published)
        self.refusals.forget(published)
        PUBLISHED.inc(len(published))
        await self.set_aside(
            conn, {i: r for i, r in refused_by_id.items() if self.refusals.refused(i)}
        )
        return len(events)

    async def _fetch_batch(
        self, conn: psycopg.AsyncConnection
    ) -> tuple[list[int], list[StoredEvent]]:
        async with conn.cursor(row_factory=dict_row) as cursor:
            await cursor.execute(_FETCH_BATCH, (self.batch_size,))
            rows = await cursor.fetchall()
        return [row["outbox_id"] for row in rows], [event_from_row(row) for row in rows]

    async def mark_published(self, conn: psycopg.AsyncConnection, ids: Sequence[int]) -> None:
        await conn.execute("DELETE FROM outbox WHERE id = ANY(%s)", (list(ids),))

    async def set_aside(
        self, conn: psycopg.AsyncConnection, refused: Mapping[int, Refused]
    ) -> None:
        """Moves the outbox rows (by id) of the `refused` events to `dead_letters`."""
        if not refused:
            return
        events = list(refused.values())
        async with conn.transaction():
            await conn.execute(
                _SET_ASIDE,
                (
                    [r.event.run_id for r in events],
                    [r.event.seq for r in events],
                    [r.error[:2000] for r in events],
                ),
            )
            await self.mark_published(conn, list(refused))
        DEAD_LETTERED.inc(len(events))
        for r in events:
            log.error(
                "event set aside in dead_letters",
                run_id=r.event.run_id,
                seq=r.event.seq,
                kind=str(r.event.kind),
                error=r.error,
            )


_SET_ASIDE = """
    INSERT INTO dead_letters (run_id, seq, error)
    SELECT * FROM unnest(%s::text[], %s::bigint[], %s::text[])
"""

_FETCH_BATCH = """
    SELECT o.id AS outbox_id, e.run_id, e.seq, e.kind, e.tenant_id, e.payload, e.traceparent,
           e.created_at
    FROM outbox o JOIN run_events e ON e.run_id = o.run_id AND e.seq = o.seq
    ORDER BY o.id
    LIMIT %s
"""
