import asyncio
import base64
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
import sqlalchemy as sa
from google.protobuf import timestamp_pb2

from services.core.config import CommonSettings
from services.core.db import Database
from services.core.event_store import EventStore
from services.core.pricing import PriceTable
from services.core.ratelimit import FAILURE_BURST
from services.core.schema import kv_reservations, ledger_entries, runs
from services.ledger.app import LedgerSettings, create_ledger_server
from services.ledger.sweep import Sweeper
from tests.services.ledger.runs import age_runs, create_tenant, queued_run, terminal_run, usage
from tollgate.errors import unpack_details
from tollgate.v1 import ledger_pb2, ledger_pb2_grpc

ADMIN = "admin-secret-token"


@dataclass
class Ledger:
    stub: ledger_pb2_grpc.LedgerServiceStub
    store: EventStore
    db: Database
    prices: PriceTable

    async def billed_run(self, tenant_id: str, **kwargs) -> str:  # type: ignore[no-untyped-def]
        run_id = await terminal_run(self.store, tenant_id, **kwargs)
        assert await Sweeper(self.db, self.prices, grace=0).bill_one(run_id)
        return run_id


@pytest.fixture
async def ledger(db: Database, store: EventStore, prices: PriceTable) -> AsyncIterator[Ledger]:
    settings = LedgerSettings(
        common=CommonSettings("unused", "unused:0", "unused", "127.0.0.1:0"),
        admin_token=ADMIN,
        prices=prices,
        sweep_interval=5,
        sweep_grace=10,
    )
    server, port, _ = create_ledger_server(db, settings)
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield Ledger(ledger_pb2_grpc.LedgerServiceStub(channel), store, db, prices)
    await server.stop(None)


def auth(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


async def code_of(call) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value.code()


async def test_every_rpc_needs_a_valid_key(ledger: Ledger) -> None:
    stub = ledger.stub
    for call in (
        stub.GetUsage(ledger_pb2.GetUsageRequest()),
        stub.ListLedgerEntries(ledger_pb2.ListLedgerEntriesRequest()),
        stub.GetReconciliation(ledger_pb2.GetReconciliationRequest()),
        stub.GetUsage(ledger_pb2.GetUsageRequest(), metadata=auth("tg_0123456789abcdef_nope")),
        stub.GetUsage(ledger_pb2.GetUsageRequest(), metadata=auth("not-the-admin-token")),
    ):
        assert await code_of(call) == grpc.StatusCode.UNAUTHENTICATED


async def test_usage_per_tenant_and_period(ledger: Ledger) -> None:
    tenant_a, key_a = await create_tenant(ledger.db)
    tenant_b, key_b = await create_tenant(ledger.db)
    await ledger.billed_run(tenant_a, run_usage=usage(prompt=10, cached=4, output=5))
    await ledger.billed_run(tenant_a, run_usage=usage(prompt=1, cached=0, output=1))
    await ledger.billed_run(tenant_b, run_usage=usage(prompt=100, cached=0, output=0))

    mine = await ledger.stub.GetUsage(ledger_pb2.GetUsageRequest(), metadata=auth(key_a))
    assert (mine.tenant_id, mine.num_runs, mine.currency) == (tenant_a, 2, "USD")
    assert [(x.billing_type, x.quantity, x.amount_micros) for x in mine.lines] == [
        ("input_tokens", 7, 14),
        ("cached_input_tokens", 4, 4),
        ("output_tokens", 6, 48),
    ]
    assert mine.amount_micros == 66

    later = timestamp_pb2.Timestamp()
    later.GetCurrentTime()
    empty = await ledger.stub.GetUsage(
        ledger_pb2.GetUsageRequest(start_time=later), metadata=auth(key_a)
    )
    assert empty.num_runs == 0 and empty.amount_micros == 0 and len(empty.lines) == 3
    until_now = await ledger.stub.GetUsage(
        ledger_pb2.GetUsageRequest(end_time=later), metadata=auth(key_a)
    )
    assert until_now.amount_micros == 66

    other = ledger_pb2.GetUsageRequest(tenant_id=tenant_b)
    assert await code_of(ledger.stub.GetUsage(other, metadata=auth(key_a))) == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    theirs = await ledger.stub.GetUsage(other, metadata=auth(ADMIN))
    assert (theirs.num_runs, theirs.amount_micros) == (1, 200)
    everyone = await ledger.stub.GetUsage(ledger_pb2.GetUsageRequest(), metadata=auth(ADMIN))
    assert (everyone.tenant_id, everyone.num_runs, everyone.amount_micros) == ("", 3, 266)


async def list_all(ledger: Ledger, token: str, **filters: str) -> tuple[list[str], int]:
    """Every entry id, page by page of 4; returns them and the number of pages."""
    ids: list[str] = []
    page_token, pages = "", 0
    while True:
        request = ledger_pb2.ListLedgerEntriesRequest(page_size=4, page_token=page_token, **filters)
        page = await ledger.stub.ListLedgerEntries(request, metadata=auth(token))
        pages += 1
        assert len(page.entries) <= 4
        ids.extend(entry.entry_id for entry in page.entries)
        page_token = page.next_page_token
        if not page_token:
            return ids, pages


async def test_entries_page_through_without_gaps_or_duplicates(ledger: Ledger) -> None:
    tenant_a, key_a = await create_tenant(ledger.db)
    tenant_b, key_b = await create_tenant(ledger.db)
    runs_a = [await ledger.billed_run(tenant_a) for _ in range(5)]
    run_b = await ledger.billed_run(tenant_b)

    ids, pages = await list_all(ledger, key_a)
    assert len(ids) == len(set(ids)) == 15 and pages == 4
    assert set(ids) == {
        f"{r}:{t}" for r in runs_a for t in ("input_tokens", "cached_input_tokens", "output_tokens")
    }
    all_ids, _ = await list_all(ledger, ADMIN)
    assert len(all_ids) == len(set(all_ids)) == 18
    one_run, _ = await list_all(ledger, key_a, run_id=runs_a[2])
    assert sorted(one_run) == sorted(i for i in ids if i.startswith(runs_a[2]))

    first = await ledger.stub.ListLedgerEntries(
        ledger_pb2.ListLedgerEntriesRequest(run_id=runs_a[0]), metadata=auth(key_a)
    )
    entry = first.entries[0]
    assert entry.tenant_id == tenant_a and entry.HasField("create_time")
    assert entry.amount_micros == entry.quantity * entry.unit_price_micros

    hidden = ledger_pb2.ListLedgerEntriesRequest(run_id=run_b)
    assert await code_of(ledger.stub.ListLedgerEntries(hidden, metadata=auth(key_a))) == (
        grpc.StatusCode.NOT_FOUND
    )
    foreign = ledger_pb2.ListLedgerEntriesRequest(tenant_id=tenant_b)
    assert await code_of(ledger.stub.ListLedgerEntries(foreign, metadata=auth(key_a))) == (
        grpc.StatusCode.PERMISSION_DENIED
    )


@pytest.mark.parametrize(
    ("request_fields", "field"),
    [({"page_token": "garbage!"}, "page_token"), ({"page_size": -1}, "page_size")],
)
async def test_malformed_paging_is_an_invalid_argument_naming_the_field(
    ledger: Ledger, request_fields: dict[str, object], field: str
) -> None:
    _, key = await create_tenant(ledger.db)
    request = ledger_pb2.ListLedgerEntriesRequest(**request_fields)  # type: ignore[arg-type]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await ledger.stub.ListLedgerEntries(request, metadata=auth(key))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    [bad_request] = unpack_details(info.value)
    assert [v.field for v in bad_request.field_violations] == [field]


async def test_a_page_token_is_bound_to_its_filters(ledger: Ledger) -> None:
    tenant, key = await create_tenant(ledger.db)
    run_id = await ledger.billed_run(tenant)
    page = await ledger.stub.ListLedgerEntries(
        ledger_pb2.ListLedgerEntriesRequest(page_size=1), metadata=auth(key)
    )
    reused = ledger_pb2.ListLedgerEntriesRequest(
        page_size=1, page_token=page.next_page_token, run_id=run_id
    )
    assert await code_of(ledger.stub.ListLedgerEntries(reused, metadata=auth(key))) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )


async def test_reconciliation_reports_what_the_ledger_owes(ledger: Ledger) -> None:
    tenant_a, key_a = await create_tenant(ledger.db)
    tenant_b, key_b = await create_tenant(ledger.db)
    healthy = await ledger.billed_run(tenant_a)
    await ledger.billed_run(tenant_b)
    report = await ledger.stub.GetReconciliation(
        ledger_pb2.GetReconciliationRequest(), metadata=auth(ADMIN)
    )
    assert report.ok and not report.unbilled_run_ids

    unbilled = await terminal_run(ledger.store, tenant_a)
    await age_runs(ledger.db, 60)
    unreleased = await ledger.billed_run(tenant_a)
    mismatched = await ledger.billed_run(tenant_a)
    async with ledger.db.begin() as conn:
        await conn.execute(
            kv_reservations.update()
            .where(kv_reservations.c.run_id == unreleased)
            .values(released_at=None)
        )
        await conn.execute(
            ledger_entries.update()
            .where(ledger_entries.c.run_id == mismatched)
            .values(amount_micros=ledger_entries.c.amount_micros + 1)
        )
    report = await ledger.stub.GetReconciliation(
        ledger_pb2.GetReconciliationRequest(), metadata=auth(ADMIN)
    )
    assert not report.ok
    assert list(report.unbilled_run_ids) == [unbilled]
    assert list(report.unreleased_run_ids) == [unreleased]
    assert list(report.mismatched_run_ids) == [mismatched]
    assert healthy not in [*report.unreleased_run_ids, *report.mismatched_run_ids]

    mine = await ledger.stub.GetReconciliation(
        ledger_pb2.GetReconciliationRequest(), metadata=auth(key_a)
    )
    assert not mine.ok and list(mine.unbilled_run_ids) == [unbilled]
    theirs = await ledger.stub.GetReconciliation(
        ledger_pb2.GetReconciliationRequest(), metadata=auth(key_b)
    )
    assert theirs.ok


async def test_a_missing_entry_is_a_mismatch(ledger: Ledger) -> None:
    tenant, _ = await create_tenant(ledger.db)
    run_id = await ledger.billed_run(tenant, run_usage=usage(prompt=0, cached=0, output=0))
    async with ledger.db.begin() as conn:
        await conn.execute(
            sa.delete(ledger_entries).where(
                ledger_entries.c.run_id == run_id,
                ledger_entries.c.billing_type == "output_tokens",
            )
        )
    report = await ledger.stub.GetReconciliation(
        ledger_pb2.GetReconciliationRequest(), metadata=auth(ADMIN)
    )
    assert list(report.mismatched_run_ids) == [run_id]


def forged_token(entry_id: str, scope: str) -> str:
    document = {"c": "2024-01-01T00:00:00+00:00", "e": entry_id, "s": scope}
    return base64.urlsafe_b64encode(json.dumps(document).encode()).decode().rstrip("=")


async def test_ids_and_tokens_that_reach_no_sql_are_refused_by_name(ledger: Ledger) -> None:
    tenant, key = await create_tenant(ledger.db)
    nul = "a\x00b"
    for run_id in (nul, "r" * 20_000):
        request = ledger_pb2.ListLedgerEntriesRequest(run_id=run_id)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await ledger.stub.ListLedgerEntries(request, metadata=auth(key))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert len(info.value.details() or "") < 200
    forged = ledger_pb2.ListLedgerEntriesRequest(page_token=forged_token(nul, f"{tenant}/*"))
    assert await code_of(ledger.stub.ListLedgerEntries(forged, metadata=auth(key))) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    for call in (
        ledger.stub.ListLedgerEntries(
            ledger_pb2.ListLedgerEntriesRequest(tenant_id=nul), metadata=auth(ADMIN)
        ),
        ledger.stub.GetUsage(ledger_pb2.GetUsageRequest(tenant_id=nul), metadata=auth(ADMIN)),
    ):
        assert await code_of(call) == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(
    ("seconds", "nanos"),
    [(10**12, 0), (-(10**12), 0), (0, -1), (0, 10**9), (2**63 - 1, 0)],
)
async def test_usage_periods_outside_the_timestamp_range_are_refused(
    ledger: Ledger, seconds: int, nanos: int
) -> None:
    _, key = await create_tenant(ledger.db)
    for name in ("start_time", "end_time"):
        stamp = timestamp_pb2.Timestamp(seconds=seconds, nanos=nanos)
        request = ledger_pb2.GetUsageRequest(**{name: stamp})  # type: ignore[arg-type]
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await ledger.stub.GetUsage(request, metadata=auth(key))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        [bad_request] = unpack_details(info.value)
        assert [v.field for v in bad_request.field_violations] == [name]
    # The widest valid period reads as any other.
    widest = ledger_pb2.GetUsageRequest(
        start_time=timestamp_pb2.Timestamp(seconds=-62_135_596_800),
        end_time=timestamp_pb2.Timestamp(seconds=253_402_300_799, nanos=999_999_999),
    )
    assert (await ledger.stub.GetUsage(widest, metadata=auth(key))).num_runs == 0


async def test_reconciliation_reports_runs_stuck_past_the_bound(ledger: Ledger) -> None:
    tenant, _ = await create_tenant(ledger.db)
    stuck = await queued_run(ledger.store, tenant)
    young = await queued_run(ledger.store, tenant)
    async with ledger.db.begin() as conn:
        await conn.execute(
            runs.update()
            .where(runs.c.run_id == stuck)
            .values(created_at=runs.c.created_at - sa.text("interval '1 hour'"))
        )
    report = await ledger.stub.GetReconciliation(
        ledger_pb2.GetReconciliationRequest(), metadata=auth(ADMIN)
    )
    assert not report.ok
    assert list(report.stuck_run_ids) == [stuck] and young not in report.stuck_run_ids


async def test_a_peer_that_keeps_failing_is_held_back(ledger: Ledger) -> None:
    wrong = auth("tg_0123456789abcdef_" + "x" * 43)
    for _ in range(FAILURE_BURST):
        call = ledger.stub.GetUsage(ledger_pb2.GetUsageRequest(), metadata=wrong)
        assert await code_of(call) == grpc.StatusCode.UNAUTHENTICATED
    # Even the right token waits: the address is refused before any key is looked up.
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await ledger.stub.GetUsage(ledger_pb2.GetUsageRequest(), metadata=auth(ADMIN))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    details = {type(d).__name__: d for d in unpack_details(refused.value)}
    assert details["ErrorInfo"].reason == "RATE_LIMITED"
    await asyncio.sleep(details["RetryInfo"].retry_delay.ToTimedelta().total_seconds())
    await ledger.stub.GetUsage(ledger_pb2.GetUsageRequest(), metadata=auth(ADMIN))


async def test_usage_shows_spend_against_budget_and_the_limits_left(ledger: Ledger) -> None:
    tenant_id, key = await create_tenant(ledger.db)
    await ledger.billed_run(tenant_id, run_usage=usage(prompt=10, cached=0, output=5))
    async with ledger.db.begin() as conn:
        await conn.execute(
            sa.text(
                "UPDATE tenants SET budget_micros = 1000, budget_period = 'day',"
                " requests_per_minute = 5 WHERE tenant_id = :t"
            ),
            {"t": tenant_id},
        )
        await conn.execute(
            sa.text(
                "INSERT INTO budget_spend VALUES"
                " (:s, date_trunc('day', clock_timestamp(), 'UTC'), 300)"
            ),
            {"s": f"tenant:{tenant_id}"},
        )
    answer = await ledger.stub.GetUsage(ledger_pb2.GetUsageRequest(), metadata=auth(key))
    limits = {x.name: x for x in answer.limits}
    assert set(limits) == {"budget_micros", "requests_per_minute"}
    budget = limits["budget_micros"]
    assert (budget.subject, budget.used, budget.remaining) == (f"tenant:{tenant_id}", 300, 700)
    assert budget.budget_period == "day" and budget.reset_time.ToDatetime().hour == 0
    requests = limits["requests_per_minute"]
    assert (requests.limit, requests.used, requests.remaining) == (5, 1, 4)


async def test_a_tenants_reconciliation_covers_its_runs_of_the_last_week(ledger: Ledger) -> None:
    tenant, key = await create_tenant(ledger.db)
    old = await terminal_run(ledger.store, tenant)  # never billed
    async with ledger.db.begin() as conn:
        await conn.execute(
            runs.update()
            .where(runs.c.run_id == old)
            .values(
                created_at=runs.c.created_at - sa.text("interval '8 days'"),
                updated_at=runs.c.updated_at - sa.text("interval '8 days'"),
            )
        )
    mine = await ledger.stub.GetReconciliation(
        ledger_pb2.GetReconciliationRequest(), metadata=auth(key)
    )
    assert mine.ok
    everyone = await ledger.stub.GetReconciliation(
        ledger_pb2.GetReconciliationRequest(), metadata=auth(ADMIN)
    )
    assert list(everyone.unbilled_run_ids) == [old]
