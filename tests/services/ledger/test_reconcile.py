"""Each invariant of `services/ledger/reconcile.py`, broken on purpose in a real database:
the report names the run that breaks it, and only that invariant."""

from __future__ import annotations

import json
from typing import Any

import pytest
import sqlalchemy as sa

from services.core.db import Database
from services.core.event_store import EventStore
from services.core.pricing import PriceTable
from services.core.schema import kv_reservations, ledger_entries, outbox, run_events, runs
from services.ledger.reconcile import TENANT_WINDOW_SECONDS, InvariantReport, Scope, check
from services.ledger.sweep import Sweeper
from tests.services.ledger.runs import create_tenant, queued_run, terminal_run


async def billed(store: EventStore, db: Database, prices: PriceTable, tenant_id: str) -> str:
    run_id = await terminal_run(store, tenant_id)
    assert await Sweeper(db, prices, grace=0).bill_one(run_id)
    return run_id


@pytest.fixture
async def billed_run(db: Database, store: EventStore, prices: PriceTable) -> str:
    """A run billed as the ledger bills it, of a tenant of its own."""
    tenant, _ = await create_tenant(db)
    return await billed(store, db, prices, tenant)


async def report(db: Database, scope: Scope | None = None) -> InvariantReport:
    return await check(db, scope or Scope(), unbilled_grace=10, stuck_after=60)


async def test_healthy_runs_break_nothing(
    db: Database, store: EventStore, prices: PriceTable
) -> None:
    tenant, _ = await create_tenant(db)
    run_id = await billed(store, db, prices, tenant)
    await queued_run(store, tenant)  # young: not stuck
    async with db.begin() as conn:
        # A model may stream a NUL, which PostgreSQL's JSON operators refuse to read.
        await conn.execute(
            sa.text(
                "UPDATE run_events SET payload = CAST(:payload AS json)"
                " WHERE run_id = :run_id AND kind = 'streaming'"
            ),
            {"run_id": run_id, "payload": '{"token_ids": [0, 1, 2, 3, 4], "text": "a\\u0000"}'},
        )
    result = await report(db)
    assert result.ok and result.broken() == {}


async def test_a_second_terminal_event_after_billed_is_misended(
    db: Database, billed_run: str
) -> None:
    run_id = billed_run
    await _add_event(db, run_id, "completed")
    assert (await report(db)).broken() == {"misended": [run_id]}


async def test_a_missing_event_is_a_seq_gap(db: Database, billed_run: str) -> None:
    run_id = billed_run
    async with db.begin() as conn:
        lost = sa.and_(run_events.c.run_id == run_id, run_events.c.seq == 2)
        await conn.execute(sa.delete(outbox).where(outbox.c.run_id == run_id, outbox.c.seq == 2))
        await conn.execute(sa.delete(run_events).where(lost))
    assert (await report(db)).broken() == {"seq_gap": [run_id]}


async def test_two_entries_for_one_key_and_billing_type_are_double_billed(
    db: Database, billed_run: str
) -> None:
    run_id = billed_run
    async with db.begin() as conn:
        # Only a database without its constraint can hold this; the report still sees it.
        await conn.execute(
            sa.text("ALTER TABLE ledger_entries DROP CONSTRAINT ledger_entries_once")
        )
        await conn.execute(
            sa.text(
                "INSERT INTO ledger_entries SELECT entry_id || '-again', tenant_id, run_id,"
                " idempotency_key, billing_type, model, 0, unit_price_micros, 0, currency,"
                " created_at FROM ledger_entries WHERE run_id = :run_id"
                " AND billing_type = 'input_tokens'"
            ),
            {"run_id": run_id},
        )
    broken = (await report(db)).broken()
    # Four entries where three belong: the ledger's own totals do not add up either.
    assert broken == {"double_billed": [run_id], "mismatched": [run_id]}


async def test_billed_output_tokens_other_than_the_streamed_ones_are_a_token_mismatch(
    db: Database, billed_run: str
) -> None:
    run_id = billed_run
    async with db.begin() as conn:
        await conn.execute(
            ledger_entries.update()
            .where(
                ledger_entries.c.run_id == run_id, ledger_entries.c.billing_type == "output_tokens"
            )
            .values(quantity=ledger_entries.c.quantity + 1)
        )
    assert (await report(db)).broken() == {"token_mismatch": [run_id]}


async def test_held_reservations_unbilled_and_stuck_runs_are_named(
    db: Database, store: EventStore, prices: PriceTable
) -> None:
    tenant, _ = await create_tenant(db)
    unreleased = await billed(store, db, prices, tenant)
    unbilled = await terminal_run(store, tenant)
    stuck = await queued_run(store, tenant)
    async with db.begin() as conn:
        await conn.execute(
            kv_reservations.update()
            .where(kv_reservations.c.run_id == unreleased)
            .values(released_at=None)
        )
        await conn.execute(
            runs.update()
            .where(runs.c.run_id.in_([unbilled, stuck]))
            .values(
                created_at=runs.c.created_at - sa.text("interval '2 minutes'"),
                updated_at=runs.c.updated_at - sa.text("interval '2 minutes'"),
            )
        )
    assert (await report(db)).broken() == {
        "unreleased": [unreleased],
        "unbilled": [unbilled],
        "stuck": [stuck],
    }
    # Runs created before the window are left out; so are other tenants'.
    recent = await report(db, Scope(since_seconds=60))
    assert recent.broken() == {"unreleased": [unreleased]}
    other, _ = await create_tenant(db)
    assert (await report(db, Scope(tenant_id=other))).ok


async def _add_event(db: Database, run_id: str, kind: str) -> None:
    """An event past the run's last, written as no service would."""
    async with db.begin() as conn:
        last_seq = await conn.scalar(sa.select(runs.c.last_seq).where(runs.c.run_id == run_id))
        tenant_id = await conn.scalar(sa.select(runs.c.tenant_id).where(runs.c.run_id == run_id))
        await conn.execute(
            run_events.insert().values(
                run_id=run_id,
                seq=last_seq + 1,
                kind=kind,
                tenant_id=tenant_id,
                payload={},
                traceparent="",
            )
        )
        await conn.execute(
            runs.update().where(runs.c.run_id == run_id).values(last_seq=last_seq + 1)
        )


# Other tenants' billed runs, each with five events, three entries and a reservation.
_CROWD = (
    """
    INSERT INTO runs (run_id, tenant_id, model, priority, state, last_seq, idempotency_key)
    SELECT 'crowd-' || i, 'crowd-' || (i % 200), 'tiny', 'interactive', 'billed', 5,
           'run:crowd-' || i
    FROM generate_series(1, :n) i
    """,
    """
    INSERT INTO run_events (run_id, seq, kind, tenant_id, payload)
    SELECT 'crowd-' || i, e.seq, e.kind, 'crowd-' || (i % 200), CAST(e.payload AS json)
    FROM generate_series(1, :n) i CROSS JOIN (VALUES
        (1, 'queued', '{}'), (2, 'prefill', '{}'),
        (3, 'streaming', '{"token_ids": [1, 2], "text": "hi"}'),
        (4, 'completed', '{}'), (5, 'billed', '{"amount_micros": 0}')
    ) e(seq, kind, payload)
    """,
    """
    INSERT INTO ledger_entries (entry_id, tenant_id, run_id, idempotency_key, billing_type,
                                model, quantity, unit_price_micros, amount_micros, currency)
    SELECT 'crowd-' || i || '-' || t, 'crowd-' || (i % 200), 'crowd-' || i, 'run:crowd-' || i,
           t, 'tiny', 2, 0, 0, 'USD'
    FROM generate_series(1, :n) i
    CROSS JOIN unnest(ARRAY['input_tokens', 'cached_input_tokens', 'output_tokens']) t
    """,
    """
    INSERT INTO kv_reservations (run_id, tenant_id, num_kv_blocks, released_at)
    SELECT 'crowd-' || i, 'crowd-' || (i % 200), 1, now() FROM generate_series(1, :n) i
    """,
    # And a tenth as many in flight: queued, their reservations held.
    """
    INSERT INTO runs (run_id, tenant_id, model, priority, state, last_seq, idempotency_key)
    SELECT 'crowd-queued-' || i, 'crowd-' || (i % 200), 'tiny', 'interactive', 'queued', 1,
           'run:crowd-queued-' || i
    FROM generate_series(1, :n / 10) i
    """,
    """
    INSERT INTO run_events (run_id, seq, kind, tenant_id, payload)
    SELECT 'crowd-queued-' || i, 1, 'queued', 'crowd-' || (i % 200), CAST('{}' AS json)
    FROM generate_series(1, :n / 10) i
    """,
    """
    INSERT INTO kv_reservations (run_id, tenant_id, num_kv_blocks)
    SELECT 'crowd-queued-' || i, 'crowd-' || (i % 200), 1 FROM generate_series(1, :n / 10) i
    """,
)
NUM_CROWD_RUNS = 20_000
_READ = {"runs", "run_events", "ledger_entries", "kv_reservations"}


def rows_read(plan: dict[str, Any], found: dict[str, int]) -> dict[str, int]:
    """Rows each scan of a run table read (kept or filtered out), over every loop."""
    relation = plan.get("Relation Name")
    if relation in _READ:
        per_loop = (
            plan["Actual Rows"]
            + plan.get("Rows Removed by Filter", 0)
            + plan.get("Rows Removed by Index Recheck", 0)
        )
        found[relation] = found.get(relation, 0) + per_loop * plan["Actual Loops"]
    for child in plan.get("Plans", []):
        rows_read(child, found)
    return found


async def test_a_tenants_check_reads_its_own_runs_not_everyones(
    db: Database, store: EventStore, prices: PriceTable
) -> None:
    async with db.begin() as conn:
        for statement in _CROWD:
            await conn.execute(sa.text(statement), {"n": NUM_CROWD_RUNS})
    async with db.connect() as conn:
        await conn.execution_options(isolation_level="AUTOCOMMIT")
        await conn.execute(sa.text("ANALYZE"))
    tenant, _ = await create_tenant(db)
    mine = [await billed(store, db, prices, tenant) for _ in range(2)]
    await queued_run(store, tenant)

    statements: list[tuple[str, Any]] = []

    def capture(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        if statement.lstrip().upper().startswith("SELECT"):
            statements.append((statement, parameters))

    sa.event.listen(db.sync_engine, "before_cursor_execute", capture)
    try:
        # As GetReconciliation asks for a tenant's key.
        assert (await report(db, Scope(tenant, TENANT_WINDOW_SECONDS))).ok
    finally:
        sa.event.remove(db.sync_engine, "before_cursor_execute", capture)
    assert len(statements) >= 8  # one or more per invariant

    # The tenant's three runs hold 11 events, 6 entries and 3 reservations; the crowd's,
    # 102,000 events, 60,000 entries and 2,000 reservations held.
    too_many = {}
    async with db.connect() as conn:
        for statement, parameters in statements:
            explained = await conn.exec_driver_sql(
                "EXPLAIN (ANALYZE, FORMAT JSON) " + statement, parameters
            )
            [[document]] = explained.all()
            plan = (json.loads(document) if isinstance(document, str) else document)[0]["Plan"]
            read = rows_read(plan, {})
            if any(count > 50 for count in read.values()):
                too_many[statement] = read
    assert not too_many
    assert mine  # billed, reconciled
