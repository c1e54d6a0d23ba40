"""The asyncio SDK against the scripted fake gateway, including a real server restart."""

import asyncio
from collections import deque

import pytest

from services.core.errors import FieldViolation, InvalidArgument, QuotaExceeded, Unavailable
from tests.tollgate.fake_gateway import Break, FakeServer, script, start_fake
from tollgate.aio import AsyncAdminClient, AsyncClient
from tollgate.errors import InvalidArgumentError, QuotaExceededError, RunFailedError
from tollgate.types import RetryPolicy

FAST = RetryPolicy(max_attempts=5, initial_backoff=0.01, max_backoff=0.05)
ALL_SEQS = list(range(1, 10))


def client(address: str, **kwargs) -> AsyncClient:  # type: ignore[no-untyped-def]
    return AsyncClient(address, "key-1", retry=FAST, timeout=5, **kwargs)


async def test_resume_after_drops_replays_and_early_ends(fake: FakeServer) -> None:
    fake.gateway.breaks = deque(
        [Break(after=0), Break(after=2), Break(after=2, replay=2, how="end"), Break(after=1)]
    )
    async with client(fake.address) as c:
        stream = c.generate("hi", model="tiny")
        seqs = [event.seq async for event in stream]
        assert seqs == ALL_SEQS
        assert stream.text == "Hello, world"
        assert stream.finish_reason == "length"
    methods = [m for m, _, _ in fake.gateway.calls]
    # The clean early end makes the client ask how the run stands before resuming.
    assert methods == ["Generate", "Generate", "StreamRun", "GetRun", "StreamRun", "StreamRun"]
    keys = {r.idempotency_key for m, r, _ in fake.gateway.calls if m == "Generate"}
    assert len(keys) == 1 and len(fake.gateway.runs) == 1
    assert all(md["authorization"] == "Bearer key-1" for _, _, md in fake.gateway.calls)


async def test_resume_across_a_server_restart() -> None:
    first = await start_fake()
    gateway = first.gateway
    gateway.delay = 0.05
    address = first.address
    port = int(address.rsplit(":", 1)[1])
    options = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 200)]
    policy = RetryPolicy(max_attempts=20, initial_backoff=0.05, max_backoff=0.2)
    seqs: list[int] = []
    second: FakeServer | None = None
    try:
        async with AsyncClient(address, "key-1", retry=policy, options=options) as c:
            async for event in c.generate("hi", model="tiny"):
                seqs.append(event.seq)
                if event.seq == 3 and second is None:
                    await first.server.stop(0)
                    second = await start_fake(port, gateway=gateway)
    finally:
        await first.server.stop(0)
        if second is not None:
            await second.server.stop(0)
    assert seqs == ALL_SEQS
    assert [m for m, _, _ in gateway.calls][-1] == "StreamRun"


async def test_unavailable_with_retry_info_is_retried(fake: FakeServer) -> None:
    fake.gateway.generate_error = Unavailable("draining", retry_after=0.01)
    patient = RetryPolicy(max_attempts=100, initial_backoff=0.01, max_backoff=0.02)
    async with AsyncClient(fake.address, "key-1", retry=patient) as c:
        stream = c.generate("hi", model="tiny")
        task = asyncio.ensure_future(stream.wait())
        await asyncio.sleep(0.1)
        fake.gateway.generate_error = None
        await task
        assert stream.last_seq == 9
    generates = [r for m, r, _ in fake.gateway.calls if m == "Generate"]
    assert len(generates) >= 2 and len({r.idempotency_key for r in generates}) == 1


async def test_errors_map_and_are_not_retried(fake: FakeServer) -> None:
    fake.gateway.generate_error = InvalidArgument([FieldViolation("model", "unknown model")])
    async with client(fake.address) as c:
        with pytest.raises(InvalidArgumentError) as caught:
            await c.generate_text("hi", model="nope")
        assert caught.value.field_violations == [("model", "unknown model")]
        fake.gateway.generate_error = QuotaExceeded("kv blocks", "tenant:tenant-1", 1.5)
        with pytest.raises(QuotaExceededError) as quota:
            await c.generate_text("hi", model="tiny")
        assert quota.value.retry_after == pytest.approx(1.5)
    assert len(fake.gateway.calls) == 2


async def test_generate_text_stream_run_and_unary_calls(fake: FakeServer) -> None:
    async with client(fake.address) as c:
        assert await c.generate_text("hi", model="tiny") == "Hello, world"
        [run_id] = fake.gateway.runs
        events = [e async for e in c.stream_run(run_id, starting_after=7)]
        assert [(e.seq, e.kind) for e in events] == [(8, "completed"), (9, "billed")]
        assert events[1].amount_micros == 1234 and events[1].currency == "USD"
        assert (await c.get_run(run_id)).last_seq == 9
        assert [r.run_id async for r in c.iter_runs(page_size=1)] == [run_id]
        assert (await c.cancel_run(run_id)).state == "billed"  # it had ended
        fake.gateway.runs["going"] = script("going", ["a"], end="running")
        assert (await c.cancel_run("going")).state == "cancelled"
        fake.gateway.end = "failed"
        with pytest.raises(RunFailedError):
            await c.generate_text("again", model="tiny")


async def test_closing_early(fake: FakeServer) -> None:
    fake.gateway.delay = 0.01
    async with client(fake.address) as c:
        async with c.generate("hi", model="tiny") as stream:
            async for event in stream:
                if event.seq == 2:
                    break
        assert stream.last_seq == 2
    await asyncio.sleep(0.05)
    assert [m for m, _, _ in fake.gateway.calls] == ["Generate"]


async def test_admin_client(fake: FakeServer) -> None:
    async with AsyncAdminClient(fake.address, "admin-1") as admin:
        tenant = await admin.create_tenant("acme", weight=2)
        assert (await admin.get_tenant(tenant.tenant_id)).name == "acme"
        assert len(await admin.list_tenants()) == 1
        assert (await admin.create_api_key(tenant.tenant_id)).secret
        assert (await admin.revoke_api_key("k-1")).revoked
        quota = await admin.set_quota(tenant.tenant_id, max_concurrent_runs=4)
        assert quota.max_concurrent_runs == 4
        assert (await admin.get_usage()).num_runs == 2
        assert [e.run_id async for e in admin.iter_ledger_entries()] == ["r1"]
        assert (await admin.get_reconciliation()).ok
    assert fake.admin.calls[0][2]["authorization"] == "Bearer admin-1"
