import asyncio
import contextlib

from aiokafka import AIOKafkaConsumer, TopicPartition

from services.core.config import RUN_EVENTS_TOPIC, consumer_group
from services.core.db import Database
from services.core.event_store import EventStore
from services.core.kafka_consumer import EventConsumer
from services.core.pricing import PriceTable
from services.core.relay import OutboxRelay
from services.core.runs import RunState
from services.ledger.consumer import LEDGER_GROUP, LedgerConsumer
from tests.services.core.kafka_tools import CountsRecords, read_topic, wait_for
from tests.services.ledger.runs import entry_count, open_reservations, terminal_run


class KilledBeforeOffsetCommit(LedgerConsumer):
    """Dies after its billing transaction commits, before the offset commit."""

    async def commit_offsets(self, consumer: EventConsumer) -> None:
        raise RuntimeError("killed between billing and offset commit")


class Counting(CountsRecords, LedgerConsumer):
    pass


async def publish_terminal_runs(
    store: EventStore, db: Database, bootstrap: str, topic: str, n: int
) -> list[str]:
    run_ids = [await terminal_run(store) for _ in range(n)]
    relay = OutboxRelay(db, bootstrap, topic=topic)
    task = asyncio.create_task(relay.run())
    await read_topic(bootstrap, topic, min_records=4 * n)  # queued, prefill, streaming, completed
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return run_ids


async def num_billed(store: EventStore, run_ids: list[str]) -> int:
    views = [await store.get_run(r) for r in run_ids]
    return sum(1 for v in views if v is not None and v.state == RunState.BILLED)


async def consume(consumer: LedgerConsumer, until) -> None:  # type: ignore[no-untyped-def]
    task = asyncio.create_task(consumer.run())
    try:

        async def done() -> bool:
            return task.done() or await until()

        await wait_for(done, timeout=30)
        await asyncio.sleep(0.5)  # let redeliveries, if any, be processed too
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, RuntimeError):
            await task


async def committed_offsets(bootstrap: str, topic: str) -> list[int | None]:
    """The ledger group's committed offset on each partition of `topic`."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=consumer_group(LEDGER_GROUP, topic),
        enable_auto_commit=False,
    )
    await consumer.start()
    try:
        parts = consumer.partitions_for_topic(topic) or set()
        return [await consumer.committed(TopicPartition(topic, p)) for p in parts]
    finally:
        await consumer.stop()


async def test_a_consumer_killed_before_its_offset_commit_does_not_bill_twice(
    store: EventStore,
    db: Database,
    kafka_bootstrap: str,
    kafka_topic: str,
    prices: PriceTable,
) -> None:
    run_ids = await publish_terminal_runs(store, db, kafka_bootstrap, kafka_topic, 6)

    killed = KilledBeforeOffsetCommit(
        db, kafka_bootstrap, prices, topic=kafka_topic, session_timeout_ms=2000
    )
    await consume(killed, lambda: asyncio.sleep(0, False))
    first = await num_billed(store, run_ids)
    assert first >= 1
    assert not any(await committed_offsets(kafka_bootstrap, kafka_topic))

    consumer = Counting(db, kafka_bootstrap, prices, topic=kafka_topic, session_timeout_ms=2000)
    num_events = 4 * len(run_ids)

    async def redelivered_billed_and_committed() -> bool:
        # The killed consumer may have billed every run: wait for the events it took too, and
        # for their offsets, which a batch that bills nothing commits within the interval.
        return (
            consumer.seen >= num_events
            and await num_billed(store, run_ids) == len(run_ids)
            and sum(o or 0 for o in await committed_offsets(kafka_bootstrap, kafka_topic))
            == num_events
        )

    await consume(consumer, redelivered_billed_and_committed)
    assert consumer.seen == num_events
    # Offsets start at 0 on each partition of the fresh topic: committed past every event.
    assert sum(offset or 0 for offset in await committed_offsets(kafka_bootstrap, kafka_topic)) == (
        num_events
    )
    assert await num_billed(store, run_ids) == len(run_ids)
    for run_id in run_ids:
        kinds = [e.kind for e in await store.read(run_id)]
        assert kinds[-1] == RunState.BILLED and kinds.count(RunState.BILLED) == 1
    assert await entry_count(db) == 3 * len(run_ids)
    assert await open_reservations(db) == 0


def test_each_topic_has_a_group_of_its_own_and_bills_under_one_name(
    db: Database, prices: PriceTable
) -> None:
    default = LedgerConsumer(db, "unused:0", prices)
    other = LedgerConsumer(db, "unused:0", prices, topic="stack-b.run-events")
    assert (default.topic, default.group_id) == (RUN_EVENTS_TOPIC, LEDGER_GROUP)
    assert other.group_id == f"{LEDGER_GROUP}.stack-b.run-events"
    # Tracking rows name the consumer: the same run is never billed again under a new group.
    assert default.name == other.name == LEDGER_GROUP
