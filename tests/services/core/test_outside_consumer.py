"""An audit consumer outside this repo needs only aiokafka and the generated RunEvent."""

import asyncio

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import ConsumerRecord

from services.core.db import Database
from services.core.event_store import EventStore
from services.core.relay import OutboxRelay
from services.core.runs import NewEvent, RunState
from tests.services.core.events import start_run, streaming
from tollgate.v1 import events_pb2


async def consume_like_an_outsider(
    bootstrap: str, topic: str, count: int
) -> list[ConsumerRecord[bytes, bytes]]:
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, group_id="outside-auditor", auto_offset_reset="earliest"
    )
    await consumer.start()
    try:
        records: list[ConsumerRecord[bytes, bytes]] = []
        while len(records) < count:
            batch = await asyncio.wait_for(consumer.getmany(timeout_ms=500), 30)
            for part in batch.values():
                records.extend(part)
        return records
    finally:
        await consumer.stop()


async def test_cloudevents_headers_and_protobuf_values(
    store: EventStore, db: Database, kafka_bootstrap: str, kafka_topic: str
) -> None:
    run_id = await start_run(store)
    await store.append(run_id, 1, [NewEvent(RunState.PREFILL), streaming(7, 8)], traceparent="")
    relay_task = asyncio.create_task(OutboxRelay(db, kafka_bootstrap, topic=kafka_topic).run())
    try:
        records = await consume_like_an_outsider(kafka_bootstrap, kafka_topic, 3)
    finally:
        relay_task.cancel()
        await asyncio.gather(relay_task, return_exceptions=True)

    events = [events_pb2.RunEvent.FromString(r.value) for r in records]
    assert [(e.run_id, e.seq) for e in events] == [(run_id, 1), (run_id, 2), (run_id, 3)]
    assert events[0].WhichOneof("kind") == "queued"
    assert events[0].queued.prompt_token_ids == [1, 2, 3]
    assert list(events[2].streaming.token_ids) == [7, 8]
    assert events[2].state == events_pb2.RUN_STATE_STREAMING
    assert events[2].time.seconds > 0
    for record, event in zip(records, events, strict=False):
        headers = {k: v.decode() for k, v in record.headers}
        kind = event.WhichOneof("kind")
        assert headers["ce_specversion"] == "1.0"
        assert headers["ce_id"] == f"{run_id}/{event.seq}"
        assert headers["ce_type"] == f"tollgate.run.{kind}.v1"
        assert headers["ce_subject"] == run_id
        assert headers["ce_source"]
        assert headers["ce_time"].endswith("Z")
        assert headers["content-type"] == "application/protobuf"
        assert record.key == run_id.encode()
