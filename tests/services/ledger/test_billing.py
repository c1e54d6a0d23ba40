from fractions import Fraction

import sqlalchemy as sa

from services.core.codec import payload_of, to_proto
from services.core.db import Database
from services.core.event_store import EventStore
from services.core.pricing import PriceTable
from services.core.runs import RunState
from services.core.schema import kv_reservations, ledger_entries
from services.ledger.billing import bill_run
from services.ledger.reconcile import Scope, check
from tests.services.ledger.runs import entry_count, queued_run, terminal_run, usage


async def bill(db: Database, run_id: str, prices: PriceTable):  # type: ignore[no-untyped-def]
    async with db.begin() as conn:
        return await bill_run(conn, run_id, prices)


async def test_billing_a_completed_run_writes_entries_releases_and_appends_billed(
    store: EventStore, db: Database, prices: PriceTable
) -> None:
    run_id = await terminal_run(store, run_usage=usage(prompt=10, cached=4, output=5))

    result = await bill(db, run_id, prices)

    assert result is not None and result.amount_micros == 6 * 2 + 4 * 1 + 5 * 8
    assert result.num_released == 1
    async with db.connect() as conn:
        rows = (
            await conn.execute(sa.select(ledger_entries).where(ledger_entries.c.run_id == run_id))
        ).all()
        released = await conn.scalar(
            sa.select(kv_reservations.c.released_at).where(kv_reservations.c.run_id == run_id)
        )
    assert {(r.billing_type, r.quantity, r.amount_micros) for r in rows} == {
        ("input_tokens", 6, 12),
        ("cached_input_tokens", 4, 4),
        ("output_tokens", 5, 40),
    }
    assert all(r.idempotency_key == f"run:{run_id}" and r.currency == "USD" for r in rows)
    assert released is not None

    events = await store.read(run_id)
    assert [e.kind for e in events][-2:] == [RunState.COMPLETED, RunState.BILLED]
    billed = events[-1]
    assert billed.seq == result.seq == 5
    assert billed.payload["amount_micros"] == 56
    # The stored payload must survive the trip to the public protobuf event.
    message = to_proto(billed)
    assert message.billed.amount_micros == 56 and len(message.billed.entries) == 3
    assert payload_of(message)["currency"] == "USD"
    assert all(entry.HasField("create_time") for entry in message.billed.entries)
    view = await store.get_run(run_id)
    assert view is not None and view.state == RunState.BILLED


async def test_billing_twice_writes_nothing_more(
    store: EventStore, db: Database, prices: PriceTable
) -> None:
    run_id = await terminal_run(store, kind=RunState.FAILED)
    assert await bill(db, run_id, prices) is not None
    assert await bill(db, run_id, prices) is None
    assert await entry_count(db, run_id) == 3
    assert [e.kind for e in await store.read(run_id)].count(RunState.BILLED) == 1


async def test_runs_that_cannot_be_billed_are_left_alone(
    store: EventStore, db: Database, prices: PriceTable
) -> None:
    running = await queued_run(store)
    assert await bill(db, running, prices) is None
    assert await bill(db, "no-such-run", prices) is None
    assert await entry_count(db) == 0
    assert (await store.get_run(running)).state == RunState.QUEUED  # type: ignore[union-attr]


async def test_cancelled_run_without_reservation_is_billed_at_its_usage(
    store: EventStore, db: Database
) -> None:
    run_id = await terminal_run(
        store, kind=RunState.CANCELLED, run_usage=usage(prompt=3, cached=0, output=0)
    )
    async with db.begin() as conn:
        await conn.execute(kv_reservations.delete().where(kv_reservations.c.run_id == run_id))
    table = PriceTable({"tiny": {"input_tokens": 5}}, currency="EUR")
    result = await bill(db, run_id, table)
    assert result is not None and result.num_released == 0
    assert result.amount_micros == 15 and result.currency == "EUR"
    assert [e.quantity for e in result.entries] == [3, 0, 0]


async def test_a_batch_run_is_billed_at_the_discount_and_the_entries_show_it(
    store: EventStore, db: Database
) -> None:
    prices = PriceTable(batch_discount=Fraction(1, 2))
    run_id = await terminal_run(
        store, run_usage=usage(prompt=10, cached=4, output=5), priority="batch"
    )
    interactive_id = await terminal_run(store, run_usage=usage(prompt=10, cached=4, output=5))

    result = await bill(db, run_id, prices)
    assert result is not None and result.amount_micros == (12 + 4 + 40) // 2
    assert {(e.billing_type, e.unit_price_micros, e.discount_micros) for e in result.entries} == {
        ("input_tokens", 2, 6),
        ("cached_input_tokens", 1, 2),
        ("output_tokens", 8, 20),
    }
    [billed] = [e for e in await store.read(run_id) if e.kind == RunState.BILLED]
    message = to_proto(billed)
    assert message.billed.amount_micros == 28
    assert sum(entry.discount_micros for entry in message.billed.entries) == 28
    listed = await bill(db, interactive_id, prices)
    assert listed is not None and listed.amount_micros == 56
    assert all(entry.discount_micros == 0 for entry in listed.entries)
    report = await check(db, Scope(), unbilled_grace=10)
    assert report.mismatched_run_ids == []
