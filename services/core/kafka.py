"""Kafka, the bus of run events: publishing, reading in a consumer group, topics.

The one module that talks to the broker. A record is a protobuf `RunEvent`, keyed
by its run id (so each run's events share a partition and keep their order), with
its CloudEvents attributes as headers; what goes in and comes out is `StoredEvent`.
The broker (Tansu) rejects the idempotent producer and transactions, so neither
is used: the relay publishes at least once, and consumers dedupe by (run_id, seq).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Collection, Coroutine, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

import structlog
from aiokafka import (
    AIOKafkaConsumer,
    AIOKafkaProducer,
    ConsumerRebalanceListener,
    ConsumerRecord,
    TopicPartition,
)
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import (
    CorruptRecordException,
    MessageSizeTooLargeError,
    RecordTooLargeError,
    TopicAlreadyExistsError,
    for_code,
)
from aiokafka.protocol.metadata import MetadataRequest
from prometheus_client import Counter, Gauge

from services.core.codec import from_proto, kind_of, rfc3339, to_proto
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

CONTENT_TYPE = "application/protobuf"
CE_SOURCE = "//tollgate/event-store"

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Refused:
    """An event the encoder or the producer refused for itself (too large, not encodable)."""

    event: StoredEvent
    error: str


@dataclass(frozen=True, slots=True)
class Acked:
    """An event the broker acknowledged, and where it put it."""

    event: StoredEvent
    partition: int
    offset: int


@dataclass(frozen=True, slots=True)
class Record:
    """One record to publish, encoded: its key, value and headers."""

    key: bytes
    value: bytes
    headers: list[tuple[str, bytes]]


@dataclass(frozen=True, slots=True)
class Placed:
    """Where the broker put a record it acknowledged."""

    partition: int
    offset: int


@dataclass(frozen=True, slots=True)
class Published:
    acked: list[Acked]
    refused: list[Refused]


# What the producer or the broker says about one record rather than about the broker's
# state: the same record is refused again, whatever the retries.
_RECORD_ERRORS = (MessageSizeTooLargeError, RecordTooLargeError, CorruptRecordException)


class Publisher:
    """Publishes run events to `topic` (and other records to any topic, `send`); a context
    manager that connects and disconnects."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.topic = topic
        self._producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=0)

    async def __aenter__(self) -> Publisher:
        await self._producer.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        with contextlib.suppress(Exception):
            await self._producer.stop()

    async def publish(self, events: Sequence[StoredEvent]) -> Published:
        """Returns once every event of `events` is acknowledged by all in-sync replicas, with
        where each landed, but for those refused for themselves. Any other error (the broker
        away) raises, and then none of `events` is known to be published."""
        refused: list[Refused] = []
        encoded: list[tuple[StoredEvent, Record]] = []
        for event in events:
            try:
                value = to_proto(event).SerializeToString()
            except Exception as error:  # the encoder: a payload the message cannot hold
                refused.append(Refused(event, repr(error)))
                continue
            record = Record(event.run_id.encode(), value, cloudevent_headers(event))
            encoded.append((event, record))
        results = await self.send(self.topic, [record for _, record in encoded])
        acked = []
        for (event, _), result in zip(encoded, results, strict=True):
            if isinstance(result, Placed):
                acked.append(Acked(event, result.partition, result.offset))
            else:
                refused.append(Refused(event, result))
        return Published(acked, refused)

    async def send(self, topic: str, records: Sequence[Record]) -> list[Placed | str]:
        """Where each of `records` landed on `topic`, or why it was refused for itself, in
        their order, once all are acknowledged. Any other error raises, as `publish`."""
        results: list[Placed | str | None] = []
        sent: list[tuple[int, asyncio.Future[Any]]] = []
        for record in records:
            try:
                future = await self._producer.send(
                    topic, value=record.value, key=record.key, headers=record.headers
                )
            except _RECORD_ERRORS as error:
                results.append(repr(error))
                continue
            sent.append((len(results), future))
            results.append(None)
        acks = await asyncio.gather(*(future for _, future in sent), return_exceptions=True)
        for (index, _), ack in zip(sent, acks, strict=True):
            if isinstance(ack, _RECORD_ERRORS):
                results[index] = repr(ack)
            elif isinstance(ack, BaseException):
                raise ack
            else:
                results[index] = Placed(ack.partition, ack.offset)
        return [result for result in results if result is not None]


class TopicWatch:
    """What the broker holds of `topic`: its partitions and their end offsets, read without
    joining a group or creating the topic; and the topic made again when it is gone."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self._consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)

    async def __aenter__(self) -> TopicWatch:
        await self._consumer.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        with contextlib.suppress(Exception):
            await self._consumer.stop()

    async def partition_ends(self) -> dict[int, int] | None:
        """The end offset of each partition; None when the broker has no such topic."""
        client = self._consumer._client
        # Asked for by name, with creation refused: a request that allowed it would have
        # the broker make the topic with its default partitions.
        request = MetadataRequest([self.topic], allow_auto_topic_creation=False)
        response = await client.send(client.get_random_node(), request)
        [(error_code, _, _, partitions, *_)] = [t for t in response.topics if t[1] == self.topic]
        if error_code or not partitions:
            return None
        tps = [TopicPartition(self.topic, p[1]) for p in partitions]
        ends = await self._consumer.end_offsets(tps)
        return {tp.partition: offset for tp, offset in ends.items()}

    async def ensure(self, partitions: int) -> int:
        """Makes the topic with `partitions` unless the broker has it; returns how many
        partitions it has.

        One that a client's request made meanwhile, with the broker's default count, is
        kept: deleting it would leave consumer groups with committed positions in a log
        that no longer exists, and they would skip the start of the new one.
        """
        ends = await self.partition_ends()
        if ends is None:
            await create_topic(self.bootstrap, self.topic, partitions)
            ends = await self.partition_ends()
        return len(ends or ())


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


def ce_type(kind: RunState) -> str:
    return f"tollgate.run.{kind}.v1"


def cloudevent_headers(event: StoredEvent) -> list[tuple[str, bytes]]:
    """CloudEvents Kafka binding, binary mode: attributes as `ce_*` headers."""
    headers = [
        ("ce_specversion", b"1.0"),
        ("ce_id", f"{event.run_id}/{event.seq}".encode()),
        ("ce_source", CE_SOURCE.encode()),
        ("ce_type", ce_type(event.kind).encode()),
        ("ce_time", rfc3339(event.created_at).encode()),
        ("ce_subject", event.run_id.encode()),
        ("content-type", CONTENT_TYPE.encode()),
    ]
    if event.traceparent:
        headers.append(("ce_traceparent", event.traceparent.encode()))
    return headers


async def create_topic(
    bootstrap: str, name: str, partitions: int, *, replication_factor: int = 1
) -> None:
    """Create a topic; one that already exists is left as it is."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        response = await admin.create_topics([NewTopic(name, partitions, replication_factor)])
    except TopicAlreadyExistsError:
        return
    finally:
        await admin.close()
    for topic_error in response.topic_errors:
        code = topic_error[1]
        if code not in (0, TopicAlreadyExistsError.errno):
            raise for_code(code)(f"creating topic {name}: {topic_error[-1]}")


def ensure_topics(bootstrap: str, names: Sequence[str], partitions: int) -> None:
    """Create each topic unless it exists; for synchronous callers."""

    async def create_all() -> None:
        for name in names:
            await create_topic(bootstrap, name, partitions)

    _run_in_new_loop(create_all())


def _run_in_new_loop(coroutine: Coroutine[Any, Any, T]) -> T:
    # asyncio.run on the caller's thread would replace and then clear its event
    # loop, which may belong to someone else (pytest-asyncio's session loop).
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()
