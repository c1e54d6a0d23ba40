import asyncio

from prometheus_client import REGISTRY

from services.core.db import Database
from services.core.event_store import EventStore
from services.core.pricing import PriceTable
from services.core.runs import RunState, StoredEvent
from services.ledger.consumer import LedgerConsumer
from services.ledger.sweep import Sweeper
from tests.services.ledger.runs import (
    age_runs,
    entry_count,
    open_reservations,
    queued_run,
    terminal_run,
)


async def terminal_event(store: EventStore, run_id: str) -> StoredEvent:
    """The run's terminal event, as the consumer reads it from Kafka."""
    return next(e for e in await store.read(run_id) if e.kind == RunState.COMPLETED)


async def billed_counts(store: EventStore, run_ids: list[str]) -> list[int]:
    return [[e.kind for e in await store.read(r)].count(RunState.BILLED) for r in run_ids]


async def test_sweep_bills_overdue_terminal_runs_the_bus_never_delivered(
    store: EventStore, db: Database, prices: PriceTable
) -> None:
    # No relay runs: these terminal events only ever exist in PostgreSQL.
    overdue = [await terminal_run(store) for _ in range(3)]
    await age_runs(db, 30)
    fresh = await terminal_run(store)
    running = await queued_run(store)

    sweeper = Sweeper(db, prices, grace=10, batch_size=2)
    bills = await sweeper.sweep_once()

    assert sorted(b.run_id for b in bills) == sorted(overdue)
    assert await billed_counts(store, overdue) == [1, 1, 1]
    assert (await store.get_run(fresh)).state == RunState.COMPLETED  # type: ignore[union-attr]
    assert (await store.get_run(running)).state == RunState.QUEUED  # type: ignore[union-attr]
    assert await open_reservations(db) == 2
    assert await sweeper.sweep_once() == []


async def test_late_delivery_after_the_sweep_is_a_no_op(
    store: EventStore, db: Database, prices: PriceTable
) -> None:
    run_id = await terminal_run(store)
    await age_runs(db, 30)
    assert len(await Sweeper(db, prices, grace=10).sweep_once()) == 1

    consumer = LedgerConsumer(db, "unused:0", prices)
    assert await consumer.apply([await terminal_event(store, run_id)]) == 1  # tracked, no effect
    assert await entry_count(db, run_id) == 3
    assert await billed_counts(store, [run_id]) == [1]


async def test_concurrent_sweep_and_consumer_bill_each_run_once(
    store: EventStore, db: Database, prices: PriceTable
) -> None:
    run_ids = [await terminal_run(store) for _ in range(8)]
    events = [await terminal_event(store, r) for r in run_ids]
    sweeper = Sweeper(db, prices, grace=0)
    consumer = LedgerConsumer(db, "unused:0", prices)

    # Both paths race on every run, in both orders.
    jobs = []
    for i, (run_id, event) in enumerate(zip(run_ids, events, strict=True)):
        pair = [sweeper.bill_one(run_id), consumer.apply([event])]
        jobs.extend(pair if i % 2 else pair[::-1])
    await asyncio.gather(*jobs, sweeper.sweep_once())

    assert await billed_counts(store, run_ids) == [1] * len(run_ids)
    assert await entry_count(db) == 3 * len(run_ids)
    assert await open_reservations(db) == 0


def num_sweep_failures() -> float:
    return REGISTRY.get_sample_value("tollgate_ledger_sweep_failures_total") or 0.0


async def test_a_run_that_cannot_be_billed_leaves_the_rest_of_the_round_billed(
    store: EventStore, db: Database, prices: PriceTable
) -> None:
    unreadable = {"prompt_tokens": 3, "output_tokens": "many"}
    broken = await terminal_run(store, run_usage=unreadable)  # type: ignore[arg-type]
    fine = [await terminal_run(store) for _ in range(3)]
    await age_runs(db, 30)
    before = num_sweep_failures()

    bills = await Sweeper(db, prices, grace=10, batch_size=2).sweep_once()

    assert sorted(b.run_id for b in bills) == sorted(fine)
    assert await billed_counts(store, [broken, *fine]) == [0, 1, 1, 1]
    assert num_sweep_failures() == before + 1  # tried once a round, not once a batch
