"""Reading the bus of run events in a consumer group (`EventConsumer`): the records of a
poll, those of the kinds asked for decoded, their offsets committed once applied.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from types import TracebackType

import structlog
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, ConsumerRecord, TopicPartition
from prometheus_client import Counter, Gauge

from services.core.codec import from_proto, kind_of
from services.core.kafka import ce_type
from services.core.runs import RunState, StoredEvent
from tollgate.v1 import events_pb2

log = structlog.get_logger(__name__)

RECORDS_SKIPPED = Counter(
    "tollgate_kafka_records_skipped", "Records on the topic that are no run event", ["group"]
)
CONSUMER_LAG = Gauge(
    "tollgate_consumer_lag_records",
    "Records on this member's partitions not read yet (the broker's high watermark less the"
    " next offset), as of its last fetch",
    ["group"],
)


class EventConsumer:
    """A member of consumer group `group_id` reading `topic`; a reusable context manager.

    `batches()` yields the events of each poll whose kind is one of `kinds` (all when
    None), decoded; `commit()` commits the offsets of what it yielded. With
    `auto_commit` the client commits instead. `assigned` is set while the member
    holds partitions, i.e. sees new events.
    """

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        *,
        group_id: str,
        kinds: Collection[RunState] | None = None,
        auto_offset_reset: str = "earliest",
        auto_commit: bool = False,
        session_timeout_ms: int = 10_000,
        fetch_max_wait_ms: int = 50,
        assigned: asyncio.Event | None = None,
    ) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.group_id = group_id
        self.kinds = frozenset(kinds) if kinds is not None else None
        # The `ce_type` headers parsed: those of `kinds`, and none (a record without one).
        self._parsed_types = (
            {None, *(ce_type(kind).encode() for kind in kinds)} if kinds is not None else None
        )
        self.auto_offset_reset = auto_offset_reset
        self.auto_commit = auto_commit
        self.session_timeout_ms = session_timeout_ms
        # How long the broker may hold a fetch open waiting for data: the latency floor.
        self.fetch_max_wait_ms = fetch_max_wait_ms
        self.assigned = assigned or asyncio.Event()
        self.num_read = 0  # records read, of every kind, since construction
        self._uncommitted: dict[TopicPartition, int] = {}
        # The offset after the last record read, per partition (for the lag).
        self._next_offsets: dict[TopicPartition, int] = {}
        self._consumer: AIOKafkaConsumer | None = None

    async def __aenter__(self) -> EventConsumer:
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap,
            group_id=self.group_id,
            enable_auto_commit=self.auto_commit,
            auto_offset_reset=self.auto_offset_reset,
            session_timeout_ms=self.session_timeout_ms,
            heartbeat_interval_ms=max(100, self.session_timeout_ms // 4),
            fetch_max_wait_ms=self.fetch_max_wait_ms,
        )
        self._consumer.subscribe([self.topic], listener=_Assignment(self.assigned))
        self._uncommitted = {}
        try:
            await self._consumer.start()
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.assigned.clear()
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None

    async def batches(self) -> AsyncIterator[list[StoredEvent]]:
        """One list per poll, of every partition read; empty when the poll brought nothing
        of `kinds`. A run's events share a partition, so they come in order."""
        assert self._consumer is not None, "used outside its context"
        while True:
            batches = await self._consumer.getmany(timeout_ms=500, max_records=500)
            records = [record for batch in batches.values() for record in batch]
            self.num_read += len(records)
            self._observe_lag(batches)
            if not self.auto_commit:
                self._uncommitted.update(
                    {tp: batch[-1].offset + 1 for tp, batch in batches.items()}
                )
            yield self.decode(records)

    def _observe_lag(self, batches: Mapping[TopicPartition, Sequence[ConsumerRecord]]) -> None:
        assert self._consumer is not None
        for tp, batch in batches.items():
            self._next_offsets[tp] = batch[-1].offset + 1
        lag = 0
        for tp in self._consumer.assignment():
            highwater = self._consumer.highwater(tp)
            if highwater is not None:
                lag += max(0, highwater - self._next_offsets.get(tp, highwater))
        CONSUMER_LAG.labels(group=self.group_id).set(lag)

    def decode(self, records: Sequence[ConsumerRecord]) -> list[StoredEvent]:
        """The events of `records` whose kind is one of `kinds`.

        A record whose `ce_type` header names another kind is passed over unparsed. A
        record that is no run event is skipped, logged and counted: read again, it would
        fail again, and hold up every record behind it. Its offset is committed with the
        others'."""
        events = []
        for record in records:
            types = self._parsed_types
            if types is not None and _header(record.headers, "ce_type") not in types:
                continue
            try:
                message = events_pb2.RunEvent.FromString(record.value)
                # Other kinds are left undecoded: a consumer of a few kinds reads many records.
                if self.kinds is None or kind_of(message) in self.kinds:
                    events.append(from_proto(message, _traceparent(record.headers)))
            except Exception as error:
                RECORDS_SKIPPED.labels(group=self.group_id).inc()
                log.error(
                    "undecodable record skipped",
                    topic=record.topic,
                    partition=record.partition,
                    offset=record.offset,
                    group=self.group_id,
                    error=repr(error),
                )
        return events

    @property
    def has_uncommitted(self) -> bool:
        """Whether events were yielded since the last `commit()`."""
        return bool(self._uncommitted)

    async def commit(self) -> None:
        """Commits the offsets of every batch yielded so far, on the partitions this member
        still holds: those handed to another member since are theirs to commit."""
        assert self._consumer is not None, "used outside its context"
        assigned = self._consumer.assignment()
        offsets = {tp: offset for tp, offset in self._uncommitted.items() if tp in assigned}
        if offsets:
            await self._consumer.commit(offsets)
        self._uncommitted.clear()

    def pause(self) -> None:
        """Stops fetching from the partitions held (the group's heartbeats go on)."""
        assert self._consumer is not None, "used outside its context"
        self._consumer.pause(*self._consumer.assignment())

    def resume(self) -> None:
        if self._consumer is not None:
            self._consumer.resume(*self._consumer.paused())


class _Assignment(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, assigned: asyncio.Event) -> None:
        self.assigned = assigned

    async def on_partitions_revoked(self, revoked: Collection[TopicPartition]) -> None:
        self.assigned.clear()

    async def on_partitions_assigned(self, assigned: Collection[TopicPartition]) -> None:
        self.assigned.set()


def _header(headers: Sequence[tuple[str, bytes | None]], name: str) -> bytes | None:
    for key, value in headers:
        if key == name:
            return value
    return None


def _traceparent(headers: Sequence[tuple[str, bytes | None]]) -> str:
    value = _header(headers, "ce_traceparent")
    return value.decode() if value else ""
