"""Reading a whole topic back, for assertions about what was published, and counting what a
consumer is handed."""

import asyncio
import time

from aiokafka import AIOKafkaConsumer, ConsumerRecord


async def read_topic(
    bootstrap: str, topic: str, *, min_records: int, timeout: float = 20
) -> list[ConsumerRecord]:
    """Every record on `topic`, once at least `min_records` are there."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        partitions = consumer.partitions_for_topic(topic) or set()
        while not partitions:
            await consumer._client.force_metadata_update()
            await asyncio.sleep(0.1)
            partitions = consumer.partitions_for_topic(topic) or set()
        from aiokafka import TopicPartition

        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        records: list[ConsumerRecord] = []
        deadline = time.monotonic() + timeout
        while len(records) < min_records and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=200)
            for part in batch.values():
                records.extend(part)
        # Give stragglers (duplicates) a moment to show up as well.
        for _ in range(3):
            batch = await consumer.getmany(timeout_ms=200)
            for part in batch.values():
                records.extend(part)
        return records
    finally:
        await consumer.stop()


async def wait_for(predicate, timeout: float = 20, interval: float = 0.05) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(interval)


class CountsRecords:
    """Mixed into a TrackingConsumer: counts the records it reads, of its kinds or not
    (redelivered ones included)."""

    @property
    def seen(self) -> int:
        return self.events.num_read  # type: ignore[attr-defined,no-any-return]
