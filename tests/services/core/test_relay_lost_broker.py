"""A broker that restarts empty (the memory-only one does; a real cluster can lose a topic):
the relay makes the topic again and publishes again every event it had published within its
window, so that the topic, and a consumer group reading through it, hold every event again."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaError

from services.core.db import Database
from services.core.event_store import EventStore
from services.core.kafka import ensure_topics
from services.core.kafka_consumer import EventConsumer
from services.core.relay import OutboxRelay
from services.core.relay_state import LostLog
from tests.services.core.events import start_run
from tests.services.core.kafka_tools import Broker, read_topic
from tests.services.core.test_relay import ids_of, running, wait_for

PARTITIONS = 8
TANSU_DEFAULT_PARTITIONS = 4

pytestmark = pytest.mark.slow


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    broker = Broker(tmp_path)
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


async def num_partitions(bootstrap: str, topic: str) -> int:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap)
    await consumer.start()
    try:
        await consumer._client.force_metadata_update()
        return len(consumer._client.cluster.partitions_for_topic(topic) or ())
    finally:
        await consumer.stop()


async def all_runs_published(bootstrap: str, topic: str, run_ids: list[str]) -> set[str]:
    """The run ids whose `queued` event is on the topic, waiting up to a while for all."""
    seen: set[str] = set()
    for _ in range(40):
        records = await read_topic(bootstrap, topic, min_records=len(run_ids), timeout=1)
        seen = {run_id for run_id, seq in ids_of(records) if seq == 1}
        if seen >= set(run_ids):
            break
        await asyncio.sleep(0.25)
    return seen


@pytest.mark.parametrize("published_after_restart", [True, False])
async def test_a_broker_restarted_empty_gets_every_event_again(
    store: EventStore, db: Database, broker: Broker, published_after_restart: bool
) -> None:
    topic = f"lost-{uuid.uuid4().hex[:8]}"
    ensure_topics(broker.bootstrap, [topic], PARTITIONS)
    before = [await start_run(store) for _ in range(6)]
    relay = OutboxRelay(
        db, broker.bootstrap, topic=topic, poll_interval=0.2, watch_interval=0.5,
        partitions=PARTITIONS,
    )  # fmt: skip
    async with running(relay):
        assert await all_runs_published(broker.bootstrap, topic, before) == set(before)
        broker.restart()
        # New events make the broker create the topic with its default partitions, and
        # their acknowledgements go back; without them, the relay's watch finds it empty.
        after = [await start_run(store) for _ in range(3)] if published_after_restart else []
        seen = await all_runs_published(broker.bootstrap, topic, before + after)
        assert seen >= set(before + after)
        # The relay makes it, unless the producer's request had the broker make it first,
        # with its default count.
        expected = (
            {PARTITIONS, TANSU_DEFAULT_PARTITIONS} if published_after_restart else {PARTITIONS}
        )
        assert await num_partitions(broker.bootstrap, topic) in expected


async def test_a_consumer_group_reading_through_the_restart_sees_every_event(
    store: EventStore, db: Database, broker: Broker
) -> None:
    topic = f"lost-{uuid.uuid4().hex[:8]}"
    ensure_topics(broker.bootstrap, [topic], PARTITIONS)
    seen: set[tuple[str, int]] = set()

    async def consume() -> None:
        consumer = EventConsumer(
            broker.bootstrap, topic, group_id="audit", auto_commit=True, session_timeout_ms=6000
        )
        while True:  # a member whose broker went away joins again
            with contextlib.suppress(KafkaError):
                async with consumer:
                    async for batch in consumer.batches():
                        seen.update((e.run_id, e.seq) for e in batch)

    relay = OutboxRelay(
        db, broker.bootstrap, topic=topic, poll_interval=0.2, watch_interval=0.5,
        partitions=PARTITIONS,
    )  # fmt: skip
    reader = asyncio.create_task(consume())
    try:
        async with running(relay):
            before = [await start_run(store) for _ in range(4)]
            await wait_for(lambda: {(r, 1) for r in before} <= seen, timeout=30)
            broker.restart()
            after = [await start_run(store) for _ in range(4)]
            await wait_for(lambda: {(r, 1) for r in before + after} <= seen, timeout=60)
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)


def test_lost_log_tells_a_log_that_went_back() -> None:
    log = LostLog({0: 5})
    assert not log.acked(0, 6) and not log.acked(1, 0)
    assert log.acked(0, 2)  # below 6: a new log


def test_lost_log_takes_an_empty_partition_that_held_records_for_a_loss() -> None:
    log = LostLog({0: 5})
    log.acked(1, 0)
    assert not log.ends_lost({0: 1, 1: 0})  # partition 1's record is new: it may not count yet
    assert not log.ends_lost({0: 1, 1: 1})  # an end short of the offsets is no loss
    assert log.ends_lost({0: 1, 1: 0})  # partition 1 held a record a check ago
    assert log.ends_lost({1: 1})  # partition 0 gone
    assert log.ends_lost(None)  # the topic gone
    log.forget()
    assert not log.ends_lost(None)
