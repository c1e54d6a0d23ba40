"""Kafka, the bus of run events: publishing, topics, records' headers.

This module and `kafka_consumer` (reading in a consumer group) are the ones that talk
to the broker. A record is a protobuf `RunEvent`, keyed
by its run id (so each run's events share a partition and keep their order), with
its CloudEvents attributes as headers; what goes in and comes out is `StoredEvent`.
The broker (Tansu) rejects the idempotent producer and transactions, so neither
is used: the relay publishes at least once, and consumers dedupe by (run_id, seq).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import structlog
from aiokafka import (
    AIOKafkaConsumer,
    AIOKafkaProducer,
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

from services.core.codec import rfc3339, to_proto
from services.core.runs import RunState, StoredEvent

log = structlog.get_logger(__name__)

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
