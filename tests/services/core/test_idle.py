"""A consumer that read nothing for a while stops fetching, and the next append wakes it."""

import asyncio
import contextlib
import time

from services.core.consumer import TrackingConsumer
from services.core.db import Database
from services.core.event_store import EventStore
from services.core.idle import IdleFetch
from services.core.relay import OutboxRelay
from services.core.runs import NewEvent, RunState
from tests.services.core.events import start_run
from tests.services.core.kafka_tools import wait_for
from tests.services.core.test_consumer import applied_effects, create_effects_table, record_effect


async def test_an_idle_consumer_sleeps_and_the_next_append_wakes_it(
    store: EventStore, db: Database, kafka_bootstrap: str, kafka_topic: str
) -> None:
    await create_effects_table(db)
    relay = asyncio.create_task(OutboxRelay(db, kafka_bootstrap, topic=kafka_topic).run())
    # Asleep, it would not look again for a minute: only the append's notice wakes it.
    idle = IdleFetch(db, idle_after=0.3, longest_sleep=60.0)
    consumer = TrackingConsumer(
        db,
        kafka_bootstrap,
        group_id="test-idle",
        handler=record_effect,
        topic=kafka_topic,
        session_timeout_ms=2000,
        idle=idle,
    )
    task = asyncio.create_task(consumer.run())
    try:
        first = await start_run(store)
        await wait_for(lambda: _applied(db, first, 1), timeout=30)
        for seq in (2, 3):
            await wait_for(idle.asleep.is_set, timeout=10)
            appended = time.monotonic()
            await store.append(first, seq - 1, [NewEvent(RunState.PREFILL if seq == 2
                                                         else RunState.CANCELLED)])  # fmt: skip
            await wait_for(lambda s=seq: _applied(db, first, s), timeout=30)  # type: ignore[misc]
            assert time.monotonic() - appended < 5.0
        assert await applied_effects(db) == {(first, 1): 1, (first, 2): 1, (first, 3): 1}
    finally:
        for running in (task, relay):
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running


async def _applied(db: Database, run_id: str, seq: int) -> bool:
    return (run_id, seq) in await applied_effects(db)
