"""Transactional outbox relay: committed run events → Kafka.

One relay publishes at a time across all processes: the holder of a PostgreSQL
session advisory lock (`services/core/leadership.py`).  When its process dies the
session ends, the lock is released, and a waiting relay takes over within
`takeover_interval`.  The relay queries on the lock's own connection, so a relay
that lost it stops publishing with its next query.

The outbox holds only unpublished rows, so an event whose transaction commits
late is still there when it becomes visible and is published then; nothing
depends on commit order matching id order.  Per-run order holds because the
appends of one run serialize on its projection row, so a run's outbox ids
increase in commit order, and the relay publishes in id order, keyed by run_id.
Delivery is at least once: a crash after the broker's ack and before the
rows are marked publishes the batch again, and consumers dedupe by (run_id, seq). A
batch's marks are written by the statement that fetches the next batch, so a pass costs
one round trip to the database; the relay writes what it holds when it stops leading.

An event the producer, the broker or the encoder refuses for itself (too large, not
encodable) would be refused again on every pass, and hold up every event behind it:
once refused `max_attempts` times it is set aside in `dead_letters`, counted and
logged, and the relay goes on. The other events of its batch go out meanwhile.

A broker can lose what it acknowledged: one that keeps its log in memory restarts
empty, a cluster can lose a topic. Published rows therefore stay in the outbox for
`republish_window` seconds with the partition and offset the broker gave them. A log
that went back (an acknowledgement at an offset below one acknowledged before on the
same partition, or a partition empty that held records) or a topic that is gone means
the broker lost them: the relay makes the topic again with its partitions (unless a
client's request made it meanwhile with the broker's default count: that one is kept) and
publishes every kept row again, in order. Consumers dedupe by (run_id, seq) as for any redelivery.

The same outbox carries the admin audit events (services/core/admin_outbox.py): a pass
that follows a notice of one (or the broker check, as a safety net) publishes them to
`admin_topic` after the run events.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime

import psycopg
import structlog
from prometheus_client import Counter, Gauge
from psycopg.rows import dict_row

from services.core.admin_outbox import drop_refused, fetch_admin_batch, publish_admin_batch
from services.core.config import (
    ADMIN_EVENTS_TOPIC,
    REPUBLISH_WINDOW_SECONDS,
    RUN_EVENTS_TOPIC,
    TOPIC_PARTITIONS,
    CommonSettings,
)
from services.core.db import ADMIN_EVENTS_CHANNEL, EVENTS_CHANNEL, Database
from services.core.event_store import event_from_row
from services.core.kafka import Placed, Publisher, Refused, TopicWatch, create_topic
from services.core.leadership import Leadership
from services.core.loop import stop_if_cancelled
from services.core.relay_state import MAX_PUBLISH_ATTEMPTS, LostLog, Refusals
from services.core.runs import StoredEvent

log = structlog.get_logger(__name__)


# Arbitrary constant naming the relay's advisory lock.
RELAY_LOCK_KEY = 0x746F6C6C  # "toll"

PUBLISHED = Counter("tollgate_relay_events_published", "Run events the relay published to Kafka")
DEAD_LETTERED = Counter(
    "tollgate_relay_events_dead_lettered", "Run events the relay set aside in dead_letters"
)
REPUBLISHED = Counter(
    "tollgate_relay_events_republished",
    "Run events published again after the broker lost them",
)
LAG = Gauge(
    "tollgate_relay_lag_seconds",
    "Age of the oldest run event the leading relay has not published yet (0: none)",
)
# How often a leading relay asks the broker whether it still holds what it acknowledged,
# and how often it forgets rows older than the window.
WATCH_INTERVAL = 2.0
# How long a relay that found nothing to publish waits for a notice before it looks anyway.
IDLE_POLL = 5.0
PRUNE_INTERVAL = 30.0


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
        partitions: int = TOPIC_PARTITIONS,
        republish_window: float = REPUBLISH_WINDOW_SECONDS,
        watch_interval: float = WATCH_INTERVAL,
        admin_topic: str = ADMIN_EVENTS_TOPIC,
    ) -> None:
        self.db = db
        self.bootstrap = bootstrap
        self.topic = topic
        self.admin_topic = admin_topic
        self.batch_size = batch_size
        self.poll_interval = poll_interval
        self.leadership = Leadership(
            db, lock_key, name="relay", takeover_interval=takeover_interval
        )
        self.refusals = Refusals(max_attempts)
        self.partitions = partitions
        self.republish_window = republish_window
        self.watch_interval = watch_interval
        self.acks = LostLog()
        self.log_went_back = False
        # Rows acknowledged and not yet marked: the next fetch marks them.
        self._unmarked: dict[int, Placed] = {}
        # Whether admin events may be waiting (one was notified, or none was looked for).
        self._admin_due = True

    @classmethod
    def from_settings(cls, db: Database, settings: CommonSettings) -> OutboxRelay:
        return cls(
            db,
            settings.kafka_bootstrap,
            topic=settings.topic,
            partitions=settings.topic_partitions,
            republish_window=settings.republish_window,
            admin_topic=settings.admin_topic,
        )

    @property
    def is_leader(self) -> asyncio.Event:
        return self.leadership.is_leader

    async def run(self) -> None:
        """Waits for the relay lock, then publishes until cancelled."""
        await self.leadership.run(self._lead)

    async def _lead(self, conn: psycopg.AsyncConnection) -> None:
        await conn.execute(f"LISTEN {EVENTS_CHANNEL}")
        await conn.execute(f"LISTEN {ADMIN_EVENTS_CHANNEL}")
        await create_topic(self.bootstrap, self.admin_topic, self.partitions)
        self._unmarked.clear()
        self._admin_due = True
        async with (
            Publisher(self.bootstrap, self.topic) as publisher,
            TopicWatch(self.bootstrap, self.topic) as watch,
        ):
            self.acks = LostLog(await _highest_offsets(conn))
            await self.check_broker(conn, watch)
            log.info("relay leading", topic=self.topic)
            try:
                await self._publish_until_cancelled(conn, publisher, watch)
            finally:
                await self._write_marks(conn)

    async def _publish_until_cancelled(
        self, conn: psycopg.AsyncConnection, publisher: Publisher, watch: TopicWatch
    ) -> None:
        loop = asyncio.get_running_loop()
        watched = pruned = loop.time()
        while True:
            stop_if_cancelled()
            published = await self.publish_once(conn, publisher)
            if self._admin_due:
                self._admin_due = False
                published = max(published, await self.publish_admin_once(conn, publisher))
            if self.log_went_back:
                await self.republish(conn, watch, "an acknowledgement went back")
            if loop.time() - watched >= self.watch_interval:
                await self.check_broker(conn, watch)
                self._admin_due = True  # in case a notice was missed
                watched = loop.time()
            if loop.time() - pruned >= PRUNE_INTERVAL:
                await self.prune(conn)
                pruned = loop.time()
            if published < self.batch_size:
                # Rows left behind (refused ones) are tried again after `poll_interval`.
                idle = max(self.poll_interval, IDLE_POLL)
                await self._wait_for_notify(conn, self.poll_interval if published else idle)

    async def check_broker(self, conn: psycopg.AsyncConnection, watch: TopicWatch) -> None:
        """Publishes every kept row again when the broker no longer holds what it acked."""
        ends = await watch.partition_ends()
        if self.acks.ends_lost(ends):
            why = f"the topic ends at {ends}, acknowledged up to {self.acks.highest}"
            await self.republish(conn, watch, why)
        elif ends is None:
            await watch.ensure(self.partitions)

    async def republish(self, conn: psycopg.AsyncConnection, watch: TopicWatch, why: str) -> None:
        num_partitions = await watch.ensure(self.partitions)
        if num_partitions != self.partitions:
            log.warning(
                "the topic came back with the broker's default partitions",
                topic=self.topic,
                num_partitions=num_partitions,
                expected=self.partitions,
            )
        await create_topic(self.bootstrap, self.admin_topic, self.partitions)
        # Marks not written yet are of records the broker lost with the rest.
        self._unmarked.clear()
        cursor = await conn.execute(_REPUBLISH)
        self.acks.forget()
        self._admin_due = True
        self.log_went_back = False
        REPUBLISHED.inc(cursor.rowcount)
        log.warning(
            "the broker lost acknowledged events: publishing them again",
            topic=self.topic,
            reason=why,
            num_events=cursor.rowcount,
        )

    async def prune(self, conn: psycopg.AsyncConnection) -> None:
        await conn.execute(_PRUNE, (self.republish_window,))

    async def _wait_for_notify(self, conn: psycopg.AsyncConnection, timeout: float) -> None:
        # Wakes on the first commit that appended events, or after `timeout` as a safety
        # net; both lead to a fresh query.
        async for notify in conn.notifies(timeout=timeout, stop_after=1):
            self._admin_due |= notify.channel == ADMIN_EVENTS_CHANNEL
        # Notifications that arrived meanwhile are all covered by the next query.
        async for notify in conn.notifies(timeout=0, stop_after=10_000):
            self._admin_due |= notify.channel == ADMIN_EVENTS_CHANNEL

    async def publish_once(self, conn: psycopg.AsyncConnection, publisher: Publisher) -> int:
        """Publishes one batch of unpublished events; returns how many.

        The queries run on the relay's own connection, the one that holds the lock
        and listens: notices that arrive meanwhile wait for the next `notifies()`.
        """
        ids, events = await self._fetch_batch(conn)
        observe_lag(events)
        if not events:
            return 0
        # Marked only once the broker has them all: a crash in between publishes them again.
        result = await publisher.publish(events)
        outbox_ids = {(e.run_id, e.seq): i for i, e in zip(ids, events, strict=True)}
        refused_by_id = {outbox_ids[r.event.run_id, r.event.seq]: r for r in result.refused}
        published = {
            outbox_ids[a.event.run_id, a.event.seq]: Placed(a.partition, a.offset)
            for a in result.acked
        }
        self.mark_published(published)
        for acked in result.acked:
            self.log_went_back |= self.acks.acked(acked.partition, acked.offset)
        self.refusals.forget(published)
        PUBLISHED.inc(len(published))
        await self.set_aside(
            conn, {i: r for i, r in refused_by_id.items() if self.refusals.refused(i)}
        )
        return len(events)

    async def publish_admin_once(self, conn: psycopg.AsyncConnection, publisher: Publisher) -> int:
        """Publishes one batch of unpublished admin events; returns how many."""
        batch = await fetch_admin_batch(conn, self.batch_size)
        if not batch:
            return 0
        placed, refused = await publish_admin_batch(publisher, self.admin_topic, batch)
        self.mark_published(placed)
        self.refusals.forget(placed)
        await drop_refused(conn, {i: e for i, e in refused.items() if self.refusals.refused(i)})
        return len(batch)

    async def _fetch_batch(
        self, conn: psycopg.AsyncConnection
    ) -> tuple[list[int], list[StoredEvent]]:
        """The next batch of unpublished run events, with their outbox ids; the statement
        also marks the rows acknowledged since the last one (left out of the batch, which
        it reads as of before its own marks)."""
        marks = self._take_marks()
        async with conn.cursor(row_factory=dict_row) as cursor:
            await cursor.execute(self._marking(_FETCH_BATCH), {**marks, "limit": self.batch_size})
            rows = await cursor.fetchall()
        return [row["outbox_id"] for row in rows], [event_from_row(row) for row in rows]

    def mark_published(self, acked: Mapping[int, Placed]) -> None:
        """Notes the rows (by id) of `acked` as published, where the broker put them: the
        next fetch (or `_write_marks`) keeps them for the window with that, or drops them
        at once without a window."""
        self._unmarked.update(acked)

    async def _write_marks(self, conn: psycopg.AsyncConnection) -> None:
        """Writes the marks not written yet, as the relay stops leading; a connection
        gone with the lock leaves them to be published again by the next leader."""
        if not self._unmarked:
            return
        try:
            await conn.execute(self._marking("SELECT 1"), self._take_marks())
        except (psycopg.Error, OSError) as error:
            log.warning("relay marks not written", error=repr(error))

    def _take_marks(self) -> dict[str, list[int]]:
        marks, self._unmarked = self._unmarked, {}
        return {
            "ids": list(marks),
            "partitions": [placed.partition for placed in marks.values()],
            "offsets": [placed.offset for placed in marks.values()],
        }

    def _marking(self, statement: str) -> str:
        """`statement` preceded by the marks of the rows `%(ids)s`."""
        return (_MARK if self.republish_window else _DROP_MARKED) + statement

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
            await _delete(conn, list(refused))
        DEAD_LETTERED.inc(len(events))
        for r in events:
            log.error(
                "event set aside in dead_letters",
                run_id=r.event.run_id,
                seq=r.event.seq,
                kind=str(r.event.kind),
                error=r.error,
            )


def observe_lag(unpublished: Sequence[StoredEvent]) -> None:
    """The batch comes in outbox order, so its first event is the oldest waiting."""
    if not unpublished:
        LAG.set(0.0)
        return
    LAG.set(max(0.0, (datetime.now(UTC) - unpublished[0].created_at).total_seconds()))


_SET_ASIDE = """
    INSERT INTO dead_letters (run_id, seq, error)
    SELECT * FROM unnest(%s::text[], %s::bigint[], %s::text[])
"""

# The marks of the rows acknowledged since the last statement, ahead of the next one:
# kept for the window with where the broker put them, or dropped at once without one.
_MARK = """
    WITH marked AS (
        UPDATE outbox SET published_at = clock_timestamp(), kafka_partition = d.partition,
                          kafka_offset = d.kafka_offset
        FROM unnest(%(ids)s::bigint[], %(partitions)s::int[], %(offsets)s::bigint[])
             AS d(id, partition, kafka_offset)
        WHERE outbox.id = d.id
    )
"""
_DROP_MARKED = """
    WITH marked AS (DELETE FROM outbox WHERE id = ANY(%(ids)s::bigint[]))
"""
_FETCH_BATCH = """
    SELECT o.id AS outbox_id, e.run_id, e.seq, e.kind, e.tenant_id, e.payload, e.traceparent,
           e.created_at
    FROM outbox o JOIN run_events e ON e.run_id = o.run_id AND e.seq = o.seq
    WHERE o.published_at IS NULL AND o.id <> ALL(%(ids)s::bigint[])
    ORDER BY o.id
    LIMIT %(limit)s
"""
_REPUBLISH = """
    UPDATE outbox SET published_at = NULL, kafka_partition = NULL, kafka_offset = NULL
    WHERE published_at IS NOT NULL
"""
_PRUNE = """
    DELETE FROM outbox
    WHERE published_at < clock_timestamp() - make_interval(secs => %s::float8)
"""
# Of the run events' topic only: the admin events' offsets are another topic's.
_HIGHEST = """
    SELECT kafka_partition, max(kafka_offset) FROM outbox
    WHERE published_at IS NOT NULL AND run_id IS NOT NULL GROUP BY kafka_partition
"""


async def _delete(conn: psycopg.AsyncConnection, ids: Sequence[int]) -> None:
    await conn.execute("DELETE FROM outbox WHERE id = ANY(%s)", (list(ids),))


async def _highest_offsets(conn: psycopg.AsyncConnection) -> dict[int, int]:
    """The highest offset acknowledged on each partition, of the rows kept."""
    cursor = await conn.execute(_HIGHEST)
    return {int(partition): int(offset) for partition, offset in await cursor.fetchall()}
