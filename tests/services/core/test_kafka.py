"""The bus adapter on the real broker: what is published is read back as it was stored."""

import asyncio
import dataclasses
import uuid
from datetime import UTC, datetime

from aiokafka import ConsumerRecord
from prometheus_client import REGISTRY

from services.core.codec import to_proto
from services.core.kafka import Publisher, cloudevent_headers
from services.core.kafka_consumer import EventConsumer
from services.core.runs import RunState, StoredEvent

NOW = datetime(2026, 1, 2, 3, 4, 5, 678_000, tzinfo=UTC)


def run_events(run_id: str) -> list[StoredEvent]:
    return [
        StoredEvent(run_id, 1, RunState.QUEUED, "ten", {"model": "tiny"}, NOW, "00-ab-cd-01"),
        StoredEvent(run_id, 2, RunState.PREFILL, "ten", {"worker_id": "w1"}, NOW),
        StoredEvent(run_id, 3, RunState.STREAMING, "ten", {"token_ids": [7], "text": "x"}, NOW),
        StoredEvent(run_id, 4, RunState.CANCELLED, "ten", {"reason": "r", "usage": {}}, NOW),
    ]


async def test_events_come_back_as_stored_in_each_runs_order_and_only_of_the_kinds_asked(
    kafka_bootstrap: str, kafka_topic: str
) -> None:
    runs = [run_events(str(uuid.uuid4())) for _ in range(3)]
    async with Publisher(kafka_bootstrap, kafka_topic) as publisher:
        await publisher.publish([event for run in runs for event in run])

    wanted = {RunState.QUEUED, RunState.CANCELLED}
    consumer = EventConsumer(kafka_bootstrap, kafka_topic, group_id="test-kafka", kinds=wanted)
    read: list[StoredEvent] = []
    async with consumer:
        async for batch in consumer.batches():
            read += batch
            if consumer.num_read >= 12:
                break
        assert consumer.assigned.is_set()
    assert not consumer.assigned.is_set()
    assert consumer.num_read == 12
    for run in runs:
        assert [event for event in read if event.run_id == run[0].run_id] == [run[0], run[3]]


async def test_commit_covers_what_was_read_and_a_new_member_goes_on_from_there(
    kafka_bootstrap: str, kafka_topic: str
) -> None:
    first, second = run_events(str(uuid.uuid4())), run_events(str(uuid.uuid4()))

    async def read_one_run(events: list[StoredEvent]) -> list[StoredEvent]:
        async with Publisher(kafka_bootstrap, kafka_topic) as publisher:
            await publisher.publish(events)
        consumer = EventConsumer(kafka_bootstrap, kafka_topic, group_id="test-commit")
        read: list[StoredEvent] = []
        async with consumer:
            batches = consumer.batches()
            while len(read) < len(events):
                read += await asyncio.wait_for(anext(batches), 30)
            assert consumer.has_uncommitted
            await consumer.commit()
            assert not consumer.has_uncommitted
        return read

    assert await read_one_run(first) == first
    assert await read_one_run(second) == second


def record(value: bytes, headers: list[tuple[str, bytes]], offset: int = 0) -> ConsumerRecord:
    return ConsumerRecord(
        "topic", 0, offset, 0, 0, b"k", value, None, 1, len(value), tuple(headers)
    )


def skipped(group: str) -> float:
    sample = REGISTRY.get_sample_value("tollgate_kafka_records_skipped_total", {"group": group})
    return sample or 0.0


def test_records_of_other_kinds_are_passed_over_by_their_header_unparsed() -> None:
    queued, _, streaming, _ = run_events("run_a")
    consumer = EventConsumer("unused:0", "topic", group_id="test-decode", kinds={RunState.QUEUED})
    streaming_headers = cloudevent_headers(streaming)
    records = [
        record(to_proto(queued).SerializeToString(), cloudevent_headers(queued)),
        # Not a protobuf at all, but its header names a kind this consumer does not read.
        record(b"not a run event", streaming_headers),
        # No header to tell: the value does.
        record(to_proto(queued).SerializeToString(), []),
        record(to_proto(streaming).SerializeToString(), []),
        # Its header names a kind read here, so it is parsed, fails, and is counted.
        record(b"not a run event", cloudevent_headers(queued)),
    ]
    before = skipped("test-decode")
    assert consumer.decode(records) == [queued, dataclasses.replace(queued, traceparent="")]
    assert skipped("test-decode") == before + 1
