"""Exactly-once processing of run events from Kafka.

Each batch a consumer fetches is applied in one database transaction that also
writes a tracking row per (consumer, run_id, seq); an event whose tracking row
already exists is skipped.  Offsets are committed only after that transaction
commits, so a crash in between redelivers events that the tracking rows then
turn into no-ops.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection, Sequence

import structlog
from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from services.core.codec import kind_of
from services.core.relay import RUN_EVENTS_TOPIC
from services.core.runs import RunState
from services.core.schema import consumer_tracking
from tollgate.v1 import events_pb2

log = structlog.get_logger(__name__)

Handler = Callable[[AsyncConnection, events_pb2.RunEvent], Awaitable[None]]


class TrackingConsumer:
    """Applies each run event to `handler` once, inside the handler's transaction."""

    def __init__(
        self,
        engine: AsyncEngine,
        bootstrap: str,
        *,
        group_id: str,
        handler: Handler,
        kinds: Collection[RunState] | None = None,
        topic: str = RUN_EVENTS_TOPIC,
        name: str | None = None,
        session_timeout_ms: int = 10_000,
    ) -> None:
        self.engine = engine
        self.bootstrap = bootstrap
        self.group_id = group_id
        self.handler = handler
        self.kinds = frozenset(kinds) if kinds is not None else None
        self.topic = topic
        self.name = name or group_id
        self.session_timeout_ms = session_timeout_ms
        self.started = asyncio.Event()

    async def run(self) -> None:
        """Consumes until cancelled."""
        consumer = AIOKafkaConsumer(
            self.topic,
            bootstrap_servers=self.bootstrap,
            group_id=self.group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            session_timeout_ms=self.session_timeout_ms,
            heartbeat_interval_ms=max(100, self.session_timeout_ms // 4),
        )
        await consumer.start()
        self.started.set()
        try:
            while True:
                batches = await consumer.getmany(timeout_ms=500, max_records=500)
                for partition, records in batches.items():
                    await self.apply(records)
                    await self.commit_offsets(consumer, {partition: records[-1].offset + 1})
        finally:
            await consumer.stop()

    async def apply(self, records: Sequence[ConsumerRecord]) -> int:
        """Applies a batch in one transaction; returns how many events were new."""
        applied = 0
        async with self.engine.begin() as conn:
            for record in records:
                event = events_pb2.RunEvent.FromString(record.value)
                if self.kinds is not None and kind_of(event) not in self.kinds:
                    continue
                if await self._track(conn, event):
                    await self.handler(conn, event)
                    applied += 1
        return applied

    async def _track(self, conn: AsyncConnection, event: events_pb2.RunEvent) -> bool:
        """Writes the tracking row; False when this consumer applied the event before."""
        inserted = await conn.execute(
            pg_insert(consumer_tracking)
            .values(consumer=self.name, run_id=event.run_id, seq=event.seq)
            .on_conflict_do_nothing()
            .returning(consumer_tracking.c.seq)
        )
        if inserted.first() is None:
            log.debug("duplicate event skipped", run_id=event.run_id, seq=event.seq)
            return False
        return True

    async def commit_offsets(
        self, consumer: AIOKafkaConsumer, offsets: dict[TopicPartition, int]
    ) -> None:
        await consumer.commit(offsets)
