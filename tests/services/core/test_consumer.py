import asyncio
import contextlib
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

import sqlalchemy as sa
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from prometheus_client import REGISTRY
from sqlalchemy.ext.asyncio import AsyncConnection

from services.core.consumer import TrackingConsumer
from services.core.db import Database
from services.core.event_store import EventStore
from services.core.kafka_consumer import EventConsumer
from services.core.relay import OutboxRelay
from services.core.runs import NewEvent, RunState, StoredEvent
from tests.conftest import TOPIC_PARTITIONS
from tests.services.core.events import start_run
from tests.services.core.kafka_tools import CountsRecords, read_topic, wait_for
from tollgate.v1 import events_pb2

GROUP = "test-effects"


async def record_effect(conn: AsyncConnection, event: StoredEvent) -> None:
    """The consumer's effect: counts how often each (run_id, seq) was applied."""
    await conn.execute(
        sa.text(
            "INSERT INTO effects (run_id, seq, applied) VALUES (:r, :s, 1) "
            "ON CONFLICT (run_id, seq) DO UPDATE SET applied = effects.applied + 1"
        ),
        {"r": event.run_id, "s": event.seq},
    )


async def applied_effects(db: Database) -> dict[tuple[str, int], int]:
    async with db.connect() as conn:
        rows = await conn.execute(sa.text("SELECT run_id, seq, applied FROM effects"))
        return {(r.run_id, r.seq): r.applied for r in rows}


async def create_effects_table(db: Database) -> None:
    async with db.begin() as conn:
        await conn.execute(
            sa.text(
                "CREATE TABLE IF NOT EXISTS effects "
                "(run_id text, seq bigint, applied int, PRIMARY KEY (run_id, seq))"
            )
        )


async def consume_all(
    db: Database,
    bootstrap: str,
    topic: str,
    *,
    min_events: int,
    consumer_class: type[TrackingConsumer] = TrackingConsumer,
    until: Callable[[], Awaitable[bool]] | None = None,
) -> None:
    """Runs a tracking consumer until `min_events` distinct effects exist (and `until`
    holds, when given)."""
    await create_effects_table(db)
    consumer = consumer_class(
        db,
        bootstrap,
        group_id=GROUP,
        handler=record_effect,
        topic=topic,
        session_timeout_ms=2000,
    )
    task = asyncio.create_task(consumer.run())
    try:

        async def done() -> bool:
            if task.done():
                return True
            if len(await applied_effects(db)) < min_events:
                return False
            return until is None or await until()

        await wait_for(done, timeout=30)
        await asyncio.sleep(0.5)  # let duplicates, if any, be processed too
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, RuntimeError):
            await task


async def publish(
    store: EventStore, db: Database, bootstrap: str, topic: str, n: int, on_topic: int = 0
) -> list[str]:
    """Starts `n` runs of two events each and relays them to `topic`, which holds `on_topic`
    records already."""
    runs = [await start_run(store) for _ in range(n)]
    for run_id in runs:
        await store.append(run_id, 1, [NewEvent(RunState.PREFILL)])
    relay = OutboxRelay(db, bootstrap, topic=topic)
    task = asyncio.create_task(relay.run())
    await read_topic(bootstrap, topic, min_records=on_topic + 2 * n)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return runs


class CrashBeforeOffsetCommit(TrackingConsumer):
    """Dies after its database transaction commits, before the offset commit."""

    async def commit_offsets(self, consumer: EventConsumer) -> None:
        raise RuntimeError("killed between effect and offset commit")


async def committed_offsets(bootstrap: str, topic: str) -> dict[TopicPartition, int | None]:
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, group_id=GROUP, enable_auto_commit=False
    )
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or []]
        return {tp: await consumer.committed(tp) for tp in tps}
    finally:
        await consumer.stop()


async def test_crash_between_effect_and_offset_commit_applies_nothing_twice(
    store: EventStore, db: Database, kafka_bootstrap: str, kafka_topic: str
) -> None:
    runs = await publish(store, db, kafka_bootstrap, kafka_topic, 4)
    await consume_all(
        db, kafka_bootstrap, kafka_topic, min_events=1, consumer_class=CrashBeforeOffsetCommit
    )
    first = await applied_effects(db)
    assert first and all(n == 1 for n in first.values())
    assert not any((await committed_offsets(kafka_bootstrap, kafka_topic)).values())

    await consume_all(db, kafka_bootstrap, kafka_topic, min_events=8)
    assert await applied_effects(db) == {(r, s): 1 for r in runs for s in (1, 2)}


class Seeing(CountsRecords, TrackingConsumer):
    pass


async def test_offsets_are_committed_at_once_after_an_effect_else_within_the_interval(
    store: EventStore, db: Database, kafka_bootstrap: str, kafka_topic: str
) -> None:
    await publish(store, db, kafka_bootstrap, kafka_topic, 3)  # queued and prefill each
    await create_effects_table(db)

    async def read(
        kinds: set[RunState] | None,
        interval: float,
        records: int,
        until: Callable[[], Awaitable[bool]],
    ) -> None:
        """Consumes `kinds` until `records` records were handed over and `until` holds."""
        consumer = Seeing(
            db,
            kafka_bootstrap,
            group_id=GROUP,
            handler=record_effect,
            kinds=kinds,
            topic=kafka_topic,
            session_timeout_ms=2000,
            commit_interval=interval,
        )
        task = asyncio.create_task(consumer.run())
        try:
            await wait_for(lambda: consumer.seen >= records, timeout=30)
            await wait_for(until, timeout=30)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def committed_sum() -> int:
        return sum(o or 0 for o in (await committed_offsets(kafka_bootstrap, kafka_topic)).values())

    async def committed(total: int) -> bool:
        return await committed_sum() == total

    # Nothing applies: with an hour's interval, nothing is committed after every event is
    # read and two more polls.
    await read({RunState.COMPLETED}, 3600.0, 6, lambda: asyncio.sleep(1.0, True))
    assert await committed_sum() == 0
    # Read again from the start; within a short interval the offsets are committed past all.
    await read({RunState.COMPLETED}, 0.2, 6, lambda: committed(6))
    assert await applied_effects(db) == {}
    # New events that apply: committed at once, the hour's interval notwithstanding.
    new_runs = await publish(store, db, kafka_bootstrap, kafka_topic, 2, on_topic=6)
    await read(None, 3600.0, 4, lambda: committed(10))
    assert await applied_effects(db) == {(r, s): 1 for r in new_runs for s in (1, 2)}


async def rewind_group(bootstrap: str, topic: str, offsets: dict[TopicPartition, int]) -> None:
    """Joins GROUP, commits `offsets` as its member and leaves: a group seeked back."""
    rewind = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=GROUP,
        enable_auto_commit=False,
        session_timeout_ms=2000,
        heartbeat_interval_ms=500,
    )
    await rewind.start()
    try:

        async def assigned() -> bool:
            await rewind.getmany(timeout_ms=100)
            return set(offsets) <= rewind.assignment()

        await wait_for(assigned, timeout=30)
        await rewind.commit(offsets)
    finally:
        await rewind.stop()


async def test_seeking_the_group_back_changes_no_state(
    store: EventStore, db: Database, kafka_bootstrap: str, kafka_topic: str
) -> None:
    runs = await publish(store, db, kafka_bootstrap, kafka_topic, 5)
    await consume_all(db, kafka_bootstrap, kafka_topic, min_events=10)
    expected = {(r, s): 1 for r in runs for s in (1, 2)}
    assert await applied_effects(db) == expected

    committed = await committed_offsets(kafka_bootstrap, kafka_topic)
    rewound = {tp: max(0, off - 3) for tp, off in committed.items() if off is not None}
    await rewind_group(kafka_bootstrap, kafka_topic, rewound)
    now = await committed_offsets(kafka_bootstrap, kafka_topic)
    assert {tp: now[tp] for tp in rewound} == rewound

    async def read_again() -> bool:
        now = await committed_offsets(kafka_bootstrap, kafka_topic)
        return all(now[tp] == committed[tp] for tp in rewound)

    await consume_all(db, kafka_bootstrap, kafka_topic, min_events=10, until=read_again)
    assert await applied_effects(db) == expected
    async with db.connect() as conn:
        tracked = await conn.scalar(sa.text("SELECT count(*) FROM consumer_tracking"))
    assert tracked == 10


async def test_duplicate_delivery_in_one_batch_is_applied_once(
    store: EventStore, db: Database
) -> None:
    await create_effects_table(db)
    event = StoredEvent(str(uuid.uuid4()), 1, RunState.QUEUED, "t", {}, datetime.now(UTC))
    consumer = TrackingConsumer(db, "unused:0", group_id=GROUP, handler=record_effect)
    assert await consumer.apply([event, event]) == 1
    assert await consumer.apply([event]) == 0
    assert await applied_effects(db) == {(event.run_id, 1): 1}


def num_skipped() -> float:
    return (
        REGISTRY.get_sample_value("tollgate_kafka_records_skipped_total", {"group": GROUP}) or 0.0
    )


async def test_records_that_are_no_run_event_are_skipped_counted_and_committed_past(
    store: EventStore, db: Database, kafka_bootstrap: str, kafka_topic: str
) -> None:
    # Ahead of the run events in every partition: bytes protobuf cannot parse, and a
    # message that parses but names no known state.
    junk = [b"\xff" * 8, events_pb2.RunEvent(run_id="junk", seq=1, state=99).SerializeToString()]
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap)
    await producer.start()
    try:
        for partition in range(TOPIC_PARTITIONS):
            await producer.send_and_wait(kafka_topic, junk[partition % 2], partition=partition)
    finally:
        await producer.stop()
    before = num_skipped()
    runs = await publish(store, db, kafka_bootstrap, kafka_topic, 3, on_topic=TOPIC_PARTITIONS)

    async def committed_past_everything() -> bool:
        offsets = await committed_offsets(kafka_bootstrap, kafka_topic)
        return sum(offset or 0 for offset in offsets.values()) == TOPIC_PARTITIONS + 6

    await consume_all(
        db, kafka_bootstrap, kafka_topic, min_events=6, until=committed_past_everything
    )
    assert await applied_effects(db) == {(r, s): 1 for r in runs for s in (1, 2)}
    assert num_skipped() == before + TOPIC_PARTITIONS
