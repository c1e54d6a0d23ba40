"""Exactly-once processing of run events from Kafka.

Each batch a consumer fetches, from all its partitions, is applied in one
database transaction that also writes a tracking row per (consumer, run_id,
seq); an event whose tracking row already exists is skipped.  Offsets are
committed only after that transaction commits, so a crash in between
redelivers events that the tracking rows then turn into no-ops.

A batch that applies nothing (none of the consumer's kinds, or only repeats)
has its offsets committed with the next batch that applies something, or once
`commit_interval` has passed: each commit is a round trip to the broker, and
most batches of a consumer of a few kinds bring none of them. What a crash
leaves uncommitted that way is read again and skipped again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Collection, Sequence

import structlog
from sqlalchemy.ext.asyncio import AsyncConnection

from services.core.config import RUN_EVENTS_TOPIC
from services.core.db import Database, driver_cursor
from services.core.idle import IdleFetch
from services.core.kafka_consumer import EventConsumer
from services.core.runs import RunState, StoredEvent

log = structlog.get_logger(__name__)

Handler = Callable[[AsyncConnection, StoredEvent], Awaitable[None]]

# One statement per batch, whatever its size; a row that exists already is not
# returned, and neither is a repeat of a key within the batch.
_TRACK = """
    INSERT INTO consumer_tracking (consumer, run_id, seq)
    SELECT %(consumer)s, t.run_id, t.seq
    FROM unnest(%(run_ids)s::text[], %(seqs)s::bigint[]) AS t(run_id, seq)
    ON CONFLICT DO NOTHING
    RETURNING run_id, seq
"""


class TrackingConsumer:
    """Applies each run event to `handler` once, inside the handler's transaction."""

    def __init__(
        self,
        db: Database,
        bootstrap: str,
        *,
        group_id: str,
        handler: Handler,
        kinds: Collection[RunState] | None = None,
        topic: str = RUN_EVENTS_TOPIC,
        name: str | None = None,
        session_timeout_ms: int = 10_000,
        fetch_max_wait_ms: int = 50,
        commit_interval: float = 1.0,
        idle: IdleFetch | None = None,
    ) -> None:
        self.db = db
        self.group_id = group_id
        self.handler = handler
        self.topic = topic
        self.name = name or group_id
        # The longest a batch that applied nothing waits for its offsets' commit.
        self.commit_interval = commit_interval
        self.events = EventConsumer(
            bootstrap,
            topic,
            group_id=group_id,
            kinds=kinds,
            session_timeout_ms=session_timeout_ms,
            fetch_max_wait_ms=fetch_max_wait_ms,
        )
        self.started = asyncio.Event()
        # Pauses the consumer while no run event comes (services/core/idle.py).
        self.idle = idle

    async def run(self) -> None:
        """Consumes until cancelled."""
        try:
            await self._consume()
        finally:
            if self.idle is not None:
                await self.idle.aclose()

    async def _consume(self) -> None:
        async with self.events as consumer:
            self.started.set()
            last_commit = time.monotonic()
            # Every partition read in one transaction and one commit; a run's events share
            # a partition, so each run's order holds. A crash before the commit only brings
            # applied events back, and the tracking rows skip them.
            async for events in consumer.batches():
                applied = await self.apply(events)
                if consumer.has_uncommitted and (
                    applied or time.monotonic() - last_commit >= self.commit_interval
                ):
                    await self.commit_offsets(consumer)
                    last_commit = time.monotonic()
                if self.idle is not None:
                    await self.idle.after_poll(consumer)

    async def apply(self, events: Sequence[StoredEvent]) -> int:
        """Applies a batch in one transaction; returns how many events were new."""
        if not events:
            return 0
        # Handlers lock runs: in run id order, as appends to several runs do, so the two
        # cannot deadlock. The sort is stable, so each run's events keep their order.
        events = sorted(events, key=lambda event: event.run_id)
        applied = 0
        async with self.db.begin() as conn:
            new = await self._track(conn, events)
            for event in events:
                key = (event.run_id, event.seq)
                if key in new:
                    new.discard(key)  # a duplicate later in the batch is skipped too
                    await self.handler(conn, event)
                    applied += 1
                else:
                    log.debug("duplicate event skipped", run_id=event.run_id, seq=event.seq)
        return applied

    async def _track(
        self, conn: AsyncConnection, events: Sequence[StoredEvent]
    ) -> set[tuple[str, int]]:
        """Writes the batch's tracking rows; returns the (run_id, seq) not applied before."""
        async with driver_cursor(conn) as cursor:
            await cursor.execute(
                _TRACK,
                {
                    "consumer": self.name,
                    "run_ids": [event.run_id for event in events],
                    "seqs": [event.seq for event in events],
                },
            )
            return {(row["run_id"], row["seq"]) for row in await cursor.fetchall()}

    async def commit_offsets(self, consumer: EventConsumer) -> None:
        await consumer.commit()
