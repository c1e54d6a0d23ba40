"""What a tracking consumer promises for one poll, checked without a broker: the poll is
one transaction, and its handlers see runs in run id order, each run's events in order."""

import asyncio

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from services.core.consumer import Handler, TrackingConsumer
from services.core.db import Database
from services.core.event_store import EventStore
from services.core.runs import NewEvent, RunState, StoredEvent
from tests.services.core.events import start_run, streaming
from tests.services.core.test_consumer import applied_effects, create_effects_table, record_effect


def consumer(db: Database, handler: Handler, name: str = "batches") -> TrackingConsumer:
    return TrackingConsumer(db, "unused:9092", group_id=name, handler=handler, name=name)


async def records(store: EventStore, run_ids: list[str]) -> list[StoredEvent]:
    """Every stored event of the runs, in the order given, as one poll's events."""
    return [event for run_id in run_ids for event in await store.read(run_id)]


async def two_event_runs(store: EventStore, n: int) -> list[str]:
    run_ids = [await start_run(store) for _ in range(n)]
    for run_id in run_ids:
        await store.append(run_id, 1, [NewEvent(RunState.PREFILL)])
    return run_ids


async def test_a_poll_is_one_transaction(db: Database, store: EventStore) -> None:
    await create_effects_table(db)
    run_ids = await two_event_runs(store, 3)
    poll = await records(store, run_ids)
    doomed = sorted(run_ids)[-1]

    async def fails_on_the_last_run(conn: AsyncConnection, event: StoredEvent) -> None:
        await record_effect(conn, event)
        if event.run_id == doomed and event.seq == 2:
            raise RuntimeError("handler failed")

    with pytest.raises(RuntimeError):
        await consumer(db, fails_on_the_last_run).apply(poll)
    # Nothing of the poll stayed: no effect and no tracking row, so it can be applied again.
    assert await applied_effects(db) == {}
    assert await consumer(db, record_effect).apply(poll) == 6
    assert set((await applied_effects(db)).values()) == {1}


async def test_handlers_see_runs_in_run_id_order_and_each_runs_events_in_order(
    db: Database, store: EventStore
) -> None:
    run_ids = await two_event_runs(store, 4)
    seen: list[tuple[str, int]] = []

    async def note(conn: AsyncConnection, event: StoredEvent) -> None:
        seen.append((event.run_id, event.seq))

    await consumer(db, note).apply(await records(store, sorted(run_ids, reverse=True)))
    assert seen == [(run_id, seq) for run_id in sorted(run_ids) for seq in (1, 2)]


async def test_polls_over_the_same_runs_in_opposite_orders_do_not_deadlock(
    db: Database, store: EventStore
) -> None:
    run_ids = await two_event_runs(store, 2)
    for run_id in run_ids:
        await store.append(run_id, 2, [streaming(1)])

    async def lock_run(conn: AsyncConnection, event: StoredEvent) -> None:
        # As a billing handler does: the run's row, held until the poll commits.
        await conn.execute(
            sa.text("SELECT 1 FROM runs WHERE run_id = :r FOR UPDATE"), {"r": event.run_id}
        )
        await asyncio.sleep(0.1)  # both polls hold their first run before taking the next

    forward = await records(store, run_ids)
    backward = await records(store, run_ids[::-1])
    applied = await asyncio.wait_for(
        asyncio.gather(
            consumer(db, lock_run, "one").apply(forward),
            consumer(db, lock_run, "two").apply(backward),
        ),
        20,
    )
    assert applied == [6, 6]
