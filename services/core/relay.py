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
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

import psycopg
import sqlalchemy as sa
import structlog
from aiokafka import AIOKafkaProducer
from sqlalchemy.ext.asyncio import AsyncEngine

from services.core.codec import cloudevent_headers, to_proto
from services.core.config import RUN_EVENTS_TOPIC
from services.core.db import EVENTS_CHANNEL, libpq_url
from services.core.eventstore import event_from_row
from services.core.runs import StoredEvent
from services.core.schema import outbox, run_events
from services.core.telemetry import get_meter

log = structlog.get_logger(__name__)


# Arbitrary constant naming the relay's advisory lock.
RELAY_LOCK_KEY = 0x746F6C6C  # "toll"

_published = get_meter().create_counter("tollgate.relay.events_published", unit="{event}")


class OutboxRelay:
    def __init__(
        self,
        engine: AsyncEngine,
        bootstrap: str,
        *,
        topic: str = RUN_EVENTS_TOPIC,
        batch_size: int = 500,
        poll_interval: float = 1.0,
        takeover_interval: float = 0.5,
        lock_key: int = RELAY_LOCK_KEY,
    ) -> None:
        self.engine = engine
        self.bootstrap = bootstrap
        self.topic = topic
        self.batch_size = batch_size
        self.poll_interval = poll_interval
        self.takeover_interval = takeover_interval
        self.lock_key = lock_key
        self.is_leader = asyncio.Event()

    async def run(self) -> None:
        """Waits for the relay lock, then publishes until cancelled."""
        conninfo = libpq_url(self.engine.url.render_as_string(hide_password=False))
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
        producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, acks="all", linger_ms=0)
        await producer.start()
        log.info("relay leading", topic=self.topic)
        self.is_leader.set()
        try:
            while True:
                if await self.publish_once(producer) < self.batch_size:
                    await self._wait_for_notify(conn)
        finally:
            self.is_leader.clear()
            with contextlib.suppress(Exception):
                await producer.stop()

    async def _wait_for_notify(self, conn: psycopg.AsyncConnection) -> None:
        # Wakes on the first commit that appended events, or after
        # poll_interval as a safety net; both lead to a fresh query.
        async for _ in conn.notifies(timeout=self.poll_interval, stop_after=1):
            pass
        # Notifications that arrived meanwhile are all covered by the next query.
        async for _ in conn.notifies(timeout=0, stop_after=10_000):
            pass

    async def publish_once(self, producer: AIOKafkaProducer) -> int:
        """Publishes one batch of unpublished events; returns how many."""
        ids, events = await self._fetch_batch()
        if not events:
            return 0
        futures = [
            await producer.send(
                self.topic,
                value=to_proto(event).SerializeToString(),
                key=event.run_id.encode(),
                headers=cloudevent_headers(event),
            )
            for event in events
        ]
        await asyncio.gather(*futures)
        await self.mark_published(ids)
        _published.add(len(events))
        return len(events)

    async def _fetch_batch(self) -> tuple[list[int], list[StoredEvent]]:
        query = (
            sa.select(outbox.c.id, run_events)
            .join(
                run_events,
                sa.and_(run_events.c.run_id == outbox.c.run_id, run_events.c.seq == outbox.c.seq),
            )
            .order_by(outbox.c.id)
            .limit(self.batch_size)
        )
        async with self.engine.connect() as conn:
            rows = (await conn.execute(query)).all()
        return [row.id for row in rows], [event_from_row(row._mapping) for row in rows]

    async def mark_published(self, ids: Sequence[int]) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(outbox.delete().where(outbox.c.id.in_(ids)))
