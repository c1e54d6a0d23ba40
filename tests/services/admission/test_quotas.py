"""Rate, token, budget and per-key limits against the real database, across replicas."""

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import sqlalchemy as sa

from services.core.config import CommonSettings
from services.core.pricing import PriceTable
from services.ledger.app import LedgerSettings, create_ledger_server
from services.ledger.billing import bill_run
from tests.services.admission.calls import details, request, violations
from tests.services.admission.running import (
    ADMIN_TOKEN,
    MODEL,
    Admission,
    auth,
    running_admission,
)
from tests.services.admission.worker_double import complete_run
from tollgate.aio import AsyncClient
from tollgate.errors import QuotaExceededError
from tollgate.v1 import admin_pb2, ledger_pb2, ledger_pb2_grpc

ADMIN = auth(ADMIN_TOKEN)


@pytest.fixture
async def replicas(
    database_url: str, kafka_bootstrap: str, kafka_topic: str, tiny_model_dir: Path
) -> AsyncIterator[tuple[Admission, Admission]]:
    """Two admission servers, each with its own connection pool, on one database."""
    async with contextlib.AsyncExitStack() as stack:
        first, second = [
            await stack.enter_async_context(
                running_admission(database_url, kafka_bootstrap, kafka_topic, tiny_model_dir)
            )
            for _ in range(2)
        ]
        yield first, second


async def set_quota(admission: Admission, **fields: object) -> admin_pb2.Quota:
    quota = admin_pb2.Quota(**fields)  # type: ignore[arg-type]
    return await admission.admin.SetQuota(admin_pb2.SetQuotaRequest(quota=quota), metadata=ADMIN)


async def generate(admission: Admission, key: str, **overrides: object) -> object:
    """The run's id and initial metadata, or the refusal."""
    call = admission.gateway.Generate(request(**overrides), metadata=auth(key))
    try:
        event = await call.read()
        metadata = dict(await call.initial_metadata())
    except grpc.aio.AioRpcError as refused:
        return refused
    finally:
        call.cancel()
    return event.run_id, metadata


async def worst_case(admission: Admission) -> int:
    """What one `request()` reserves against a budget."""
    _, key = await admission.new_tenant_key("probe")
    run_id, _ = await generate(admission, key)  # type: ignore[misc]
    async with admission.db.connect() as conn:
        query = sa.text("SELECT spend_micros FROM kv_reservations WHERE run_id = :r")
        return int(await conn.scalar(query, {"r": run_id}) or 0)


@pytest.mark.parametrize("limit", ["requests_per_minute", "max_concurrent_runs", "budget_micros"])
async def test_fifty_at_once_on_two_replicas_admit_exactly_ten(
    replicas: tuple[Admission, Admission], limit: str
) -> None:
    first, second = replicas
    tenant_id, key = await first.new_tenant_key("busy")
    value = 10 * await worst_case(first) if limit == "budget_micros" else 10
    await set_quota(first, tenant_id=tenant_id, **{limit: value})
    outcomes = await asyncio.gather(*(generate(first if i % 2 else second, key) for i in range(50)))
    refused = [o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
    assert len(outcomes) - len(refused) == 10
    reasons = {details(r)["ErrorInfo"].reason for r in refused}
    assert {r.code() for r in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert (
        reasons
        == {
            "requests_per_minute": {"RATE_LIMITED"},
            "max_concurrent_runs": {"CONCURRENCY_LIMITED"},
            "budget_micros": {"BUDGET_EXCEEDED"},
        }[limit]
    )
    failure = details(refused[0])["QuotaFailure"].violations[0]
    assert failure.subject == f"tenant:{tenant_id}" and limit in failure.description


async def test_a_full_window_frees_when_its_oldest_run_is_a_minute_old(
    admission: Admission,
) -> None:
    tenant_id, key = await admission.new_tenant_key("windowed")
    await set_quota(admission, tenant_id=tenant_id, requests_per_minute=2)
    for _ in range(2):
        assert isinstance(await generate(admission, key), tuple)
    async with admission.db.begin() as conn:
        await conn.execute(
            sa.text(
                "UPDATE kv_reservations SET reserved_at = clock_timestamp() - interval '59.5 s'"
                " WHERE tenant_id = :t"
            ),
            {"t": tenant_id},
        )
    refused = await generate(admission, key)
    assert isinstance(refused, grpc.aio.AioRpcError)
    retry = details(refused)["RetryInfo"].retry_delay.ToNanoseconds() / 1e9
    assert 0 < retry <= 0.5
    await asyncio.sleep(retry)
    admitted = await generate(admission, key)
    assert isinstance(admitted, tuple)
    assert admitted[1]["x-ratelimit-limit-requests"] == "2"
    # Both runs of 59.5 s ago have left the window: this one is the only one in it.
    assert admitted[1]["x-ratelimit-remaining-requests"] == "1"


async def test_output_tokens_are_reserved_then_settled_to_what_the_run_produced(
    admission: Admission,
) -> None:
    tenant_id, key = await admission.new_tenant_key("settled")
    await set_quota(admission, tenant_id=tenant_id, output_tokens_per_minute=100)
    run_id, metadata = await generate(admission, key, sampling_max_tokens=60)  # type: ignore[misc]
    assert metadata["x-ratelimit-remaining-tokens"] == "40"
    refused = await generate(admission, key, sampling_max_tokens=60)
    assert isinstance(refused, grpc.aio.AioRpcError)
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    await complete_run(admission.store, run_id, [5, 6], ["a", "b"])
    async with admission.db.begin() as conn:
        assert await bill_run(conn, run_id, PriceTable()) is not None
    # Billed at 2 output tokens: 98 of the minute's 100 are free again.
    _, metadata = await generate(admission, key, sampling_max_tokens=60)  # type: ignore[misc]
    assert metadata["x-ratelimit-remaining-tokens"] == "38"


async def test_a_budget_is_settled_to_the_billed_amount(admission: Admission) -> None:
    tenant_id, key = await admission.new_tenant_key("spender")
    await set_quota(admission, tenant_id=tenant_id, budget_micros=10**6, budget_period="day")
    run_id, _ = await generate(admission, key)  # type: ignore[misc]
    await complete_run(admission.store, run_id, [5], ["a"])
    async with admission.db.begin() as conn:
        bill = await bill_run(conn, run_id, PriceTable())
        assert bill is not None
        spent = await conn.scalar(
            sa.text("SELECT spent_micros FROM budget_spend WHERE subject = :s"),
            {"s": f"tenant:{tenant_id}"},
        )
    assert spent == bill.amount_micros


async def test_a_keys_own_limit_applies_when_tighter(admission: Admission) -> None:
    tenant_id, key = await admission.new_tenant_key("keyed")
    key_id = key.split("_")[1]
    await set_quota(admission, tenant_id=tenant_id, requests_per_minute=5)
    quota = await set_quota(admission, tenant_id=tenant_id, key_id=key_id, requests_per_minute=1)
    assert quota.key_id == key_id and quota.requests_per_minute == 1
    assert isinstance(await generate(admission, key), tuple)
    refused = await generate(admission, key)
    assert isinstance(refused, grpc.aio.AioRpcError)
    failure = details(refused)["QuotaFailure"].violations[0]
    assert failure.subject == f"key:{key_id}"
    other = await admission.tenants.create_key(tenant_id)
    assert isinstance(await generate(admission, other.secret), tuple)
    tenant = await admission.admin.GetTenant(
        admin_pb2.GetTenantRequest(tenant_id=tenant_id), metadata=ADMIN
    )
    assert [q.key_id for q in tenant.key_quotas] == [key_id]


async def test_a_budget_refuses_a_model_without_a_price(
    database_url: str, kafka_bootstrap: str, kafka_topic: str, tiny_model_dir: Path
) -> None:
    priced_elsewhere = PriceTable({"another-model": {"output_tokens": 3}})
    async with running_admission(
        database_url, kafka_bootstrap, kafka_topic, tiny_model_dir, prices=priced_elsewhere
    ) as admission:
        tenant_id, key = await admission.new_tenant_key("budgeted")
        assert isinstance(await generate(admission, key), tuple)  # no budget: admitted
        await set_quota(admission, tenant_id=tenant_id, budget_micros=10**6)
        refused = await generate(admission, key)
    assert isinstance(refused, grpc.aio.AioRpcError)
    assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert details(refused)["ErrorInfo"].reason == "MODEL_NOT_PRICED"


async def test_bad_quotas_name_their_field(admission: Admission) -> None:
    tenant_id, _ = await admission.new_tenant_key("strict")
    for fields, field in (
        ({"requests_per_minute": -1}, "quota.requests_per_minute"),
        ({"budget_micros": -5}, "quota.budget_micros"),
        ({"budget_period": "week"}, "quota.budget_period"),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await set_quota(admission, tenant_id=tenant_id, **fields)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert violations(refused.value) == [field]


async def test_a_run_larger_than_a_minute_of_tokens_is_refused_as_invalid(
    admission: Admission,
) -> None:
    tenant_id, key = await admission.new_tenant_key("small")
    await set_quota(admission, tenant_id=tenant_id, output_tokens_per_minute=10)
    refused = await generate(admission, key, sampling_max_tokens=11)
    assert isinstance(refused, grpc.aio.AioRpcError)
    assert violations(refused) == ["sampling.max_tokens"]


async def test_the_sdk_reads_rate_limits_and_refusals(admission: Admission) -> None:
    tenant_id, key = await admission.new_tenant_key("sdk")
    await set_quota(admission, tenant_id=tenant_id, requests_per_minute=1)
    async with AsyncClient(admission.address, key) as client:
        async with client.generate("hello", model=MODEL, max_tokens=4) as stream:
            await anext(aiter(stream))
            limits = stream.rate_limits
        assert (limits.limit_requests, limits.remaining_requests) == (1, 0)
        assert limits.reset_requests.endswith("s")
        with pytest.raises(QuotaExceededError) as refused:
            async with client.generate("hello", model=MODEL, max_tokens=4) as again:
                await anext(aiter(again))
    assert refused.value.reason == "RATE_LIMITED"
    assert refused.value.retry_after is not None and 59 < refused.value.retry_after <= 60


@pytest.fixture
async def ledger(admission: Admission) -> AsyncIterator[ledger_pb2_grpc.LedgerServiceStub]:
    """The ledger's LedgerService on the admission's database (GetUsage's budget view)."""
    settings = LedgerSettings(
        common=CommonSettings("unused", "unused:0", "unused", "127.0.0.1:0"),
        admin_token=ADMIN_TOKEN,
        prices=PriceTable(),
        sweep_interval=5,
        sweep_grace=10,
    )
    server, port, _ = create_ledger_server(admission.db, settings)
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield ledger_pb2_grpc.LedgerServiceStub(channel)
    await server.stop(None)


async def budget_used(ledger: ledger_pb2_grpc.LedgerServiceStub, key: str, subject: str) -> int:
    """What GetUsage says `subject` spent of its budget this period."""
    answer = await ledger.GetUsage(ledger_pb2.GetUsageRequest(), metadata=auth(key))
    [budget] = [x for x in answer.limits if x.name == "budget_micros" and x.subject == subject]
    return int(budget.used)


async def reserved_spend(admission: Admission, run_id: str) -> int:
    async with admission.db.connect() as conn:
        query = sa.text("SELECT spend_micros FROM kv_reservations WHERE run_id = :r")
        return int(await conn.scalar(query, {"r": run_id}) or 0)


async def bill(admission: Admission, run_id: str, num_tokens: int = 8) -> int:
    """Plays the worker (`num_tokens` output tokens) and the ledger; the billed amount.
    At `request()`'s 8 tokens and no cached prompt, that is the run's worst case."""
    await complete_run(admission.store, run_id, list(range(num_tokens)), ["a"] * num_tokens)
    async with admission.db.begin() as conn:
        billed = await bill_run(conn, run_id, PriceTable())
    assert billed is not None
    return billed.amount_micros


def budget_exceeded(outcome: object, subject: str) -> bool:
    if not isinstance(outcome, grpc.aio.AioRpcError):
        return False
    found = details(outcome)
    return (
        found["ErrorInfo"].reason == "BUDGET_EXCEEDED"
        and found["QuotaFailure"].violations[0].subject == subject
    )


async def test_a_budget_set_partway_through_a_day_counts_what_the_day_spent(
    admission: Admission, ledger: ledger_pb2_grpc.LedgerServiceStub
) -> None:
    tenant_id, key = await admission.new_tenant_key("late-budget")
    first, _ = await generate(admission, key)  # type: ignore[misc]
    amount = await bill(admission, first)
    await set_quota(
        admission, tenant_id=tenant_id, budget_micros=amount * 5 // 2, budget_period="day"
    )
    second, _ = await generate(admission, key)  # type: ignore[misc]
    assert await reserved_spend(admission, second) == amount
    # Spent A, A in flight, a budget of 2.5 A: one more run of A does not fit.
    assert budget_exceeded(await generate(admission, key), f"tenant:{tenant_id}")
    assert await budget_used(ledger, key, f"tenant:{tenant_id}") == 2 * amount


@pytest.mark.parametrize("before", ["none", "month"])
async def test_a_run_in_flight_when_a_budget_is_set_counts_and_is_settled_to_its_bill(
    admission: Admission, ledger: ledger_pb2_grpc.LedgerServiceStub, before: str
) -> None:
    tenant_id, key = await admission.new_tenant_key(f"in-flight-{before}")
    subject = f"tenant:{tenant_id}"
    if before == "month":
        await set_quota(admission, tenant_id=tenant_id, budget_micros=10**9)
    in_flight, _ = await generate(admission, key)  # type: ignore[misc]
    worst = await reserved_spend(admission, in_flight)
    await set_quota(
        admission, tenant_id=tenant_id, budget_micros=worst * 5 // 2, budget_period="day"
    )
    assert await budget_used(ledger, key, subject) == worst
    assert isinstance(await generate(admission, key), tuple)
    assert budget_exceeded(await generate(admission, key), subject)
    # Billed at one output token: the day gives back the rest of its worst case.
    amount = await bill(admission, in_flight, num_tokens=1)
    assert amount < worst
    assert await budget_used(ledger, key, subject) == amount + worst


async def test_a_key_budget_set_partway_counts_that_keys_runs_alone(
    admission: Admission, ledger: ledger_pb2_grpc.LedgerServiceStub
) -> None:
    tenant_id, key = await admission.new_tenant_key("late-key-budget")
    key_id = key.split("_")[1]
    other = await admission.tenants.create_key(tenant_id)
    amount = await bill(admission, (await generate(admission, key))[0])  # type: ignore[index]
    assert isinstance(await generate(admission, other.secret), tuple)  # not this key's
    in_flight, _ = await generate(admission, key)  # type: ignore[misc]
    worst = await reserved_spend(admission, in_flight)
    await set_quota(
        admission,
        tenant_id=tenant_id,
        key_id=key_id,
        budget_micros=amount + worst + worst // 2,
        budget_period="day",
    )
    assert await budget_used(ledger, key, f"key:{key_id}") == amount + worst
    assert budget_exceeded(await generate(admission, key), f"key:{key_id}")
    assert isinstance(await generate(admission, other.secret), tuple)
    settled = await bill(admission, in_flight, num_tokens=1)
    assert await budget_used(ledger, key, f"key:{key_id}") == amount + settled
