"""No tenant starves another: limits on each tenant's streams and share of the queue,
a finite concurrency for new tenants, and failed authentications that cost little."""

import asyncio
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx2
import pytest
from google.protobuf import duration_pb2

from services.admission.backpressure import QueueBounds
from services.admission.cancel import Canceller
from services.admission.catalog import ModelCatalog
from services.admission.gateway import Gateway, GatewayConfig
from services.admission.grpc.admin_servicer import MAX_TENANT_WEIGHT
from services.admission.http.app import create_app
from services.admission.requests import GenerateParams, Limits, Sampling
from services.admission.stream import RunFeed
from services.admission.stream_limits import DEFAULT_MAX_CONCURRENT_STREAMS
from services.admission.tenant_store import DEFAULT_MAX_CONCURRENT_RUNS
from services.core.auth import Principal, authenticate
from services.core.db import open_db
from services.core.errors import DATABASE_AWAY, QuotaExceeded, Unauthenticated, Unavailable
from services.core.fleet import FleetView
from services.core.live import Position
from services.core.ratelimit import FAILURE_BURST, FailedAttempts
from tests.services.admission.calls import count_runs, details, request
from tests.services.admission.running import ADMIN_TOKEN, MODEL, Admission, auth
from tollgate.v1 import admin_pb2, gateway_pb2

GRACE = duration_pb2.Duration(seconds=60)
LIMITS = Limits(max_tokens=512, max_message_chars=2000)


async def set_stream_quota(admission: Admission, tenant_id: str, streams: int) -> admin_pb2.Quota:
    quota = admin_pb2.Quota(tenant_id=tenant_id, max_concurrent_streams=streams)
    return await admission.admin.SetQuota(
        admin_pb2.SetQuotaRequest(quota=quota), metadata=auth(ADMIN_TOKEN)
    )


async def test_streams_past_the_tenants_quota_are_refused(admission: Admission) -> None:
    tenant_id, key = await admission.new_tenant_key("streamer")
    assert (await set_stream_quota(admission, tenant_id, 2)).max_concurrent_streams == 2
    generate = admission.gateway.Generate(request(disconnect_grace=GRACE), metadata=auth(key))
    queued = await generate.read()
    again = gateway_pb2.StreamRunRequest(run_id=queued.run_id)
    held = admission.gateway.StreamRun(again, metadata=auth(key))
    await held.read()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await admission.gateway.StreamRun(again, metadata=auth(key)).read()
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    found = details(caught.value)
    assert found["ErrorInfo"].reason == "STREAMS_LIMITED"
    assert found["QuotaFailure"].violations[0].subject == f"tenant:{tenant_id}:concurrent_streams"
    assert found["RetryInfo"].retry_delay.ToTimedelta().total_seconds() > 0
    # Nor does a new run start whose stream would be one too many.
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await admission.gateway.Generate(request(prompt="another"), metadata=auth(key)).read()
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert await count_runs(admission) == 1
    # Another tenant streams as before; and a stream closed makes room again.
    _, other_key = await admission.new_tenant_key("quiet")
    assert (await admission.gateway.Generate(request(), metadata=auth(other_key)).read()).seq == 1
    held.cancel()
    assert (await read_first_when_room(admission, key, again)).seq == 1
    generate.cancel()


async def test_requests_racing_past_the_stream_quota_start_no_runs_they_refuse(
    admission: Admission,
) -> None:
    tenant_id, key = await admission.new_tenant_key("racing-streams")
    await set_stream_quota(admission, tenant_id, 2)
    calls = [
        admission.gateway.Generate(
            request(prompt=f"race {i}", disconnect_grace=GRACE), metadata=auth(key)
        )
        for i in range(8)
    ]
    outcomes = await asyncio.gather(*(call.read() for call in calls), return_exceptions=True)
    streamed = [o.run_id for o in outcomes if not isinstance(o, BaseException)]
    refused = [o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
    assert len(streamed) == 2 and len(refused) == 6
    assert all(details(r)["ErrorInfo"].reason == "STREAMS_LIMITED" for r in refused)
    # A refusal means no run exists: every run has the client that streams it.
    assert await count_runs(admission) == 2
    for call in calls:
        call.cancel()


async def read_first_when_room(
    admission: Admission, key: str, req: gateway_pb2.StreamRunRequest
) -> Any:
    """The stream's first event, once the server has counted a cancelled stream out."""
    for _ in range(50):
        try:
            call = admission.gateway.StreamRun(req, metadata=auth(key))
            event = await call.read()
            call.cancel()
            return event
        except grpc.aio.AioRpcError as error:
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            await asyncio.sleep(0.1)
    raise AssertionError("the closed stream was never counted out")


@dataclass
class Scheduler:
    """What the scheduler last answered, as the test sets it."""

    view: FleetView = field(default_factory=FleetView)


def direct_gateway(
    admission: Admission,
    model_dir: Path,
    scheduler: Scheduler | None = None,
    max_concurrent_streams: int = DEFAULT_MAX_CONCURRENT_STREAMS,
    **queue: Any,
) -> Gateway:
    """A Gateway on the test's database, called directly rather than through gRPC."""
    return Gateway(
        admission.db,
        ModelCatalog.load({MODEL: str(model_dir)}),
        RunFeed(admission.store.db.url.render_as_string(hide_password=False)),
        Canceller(admission.store, None),
        GatewayConfig(
            limits=LIMITS,
            queue=QueueBounds(**queue),
            max_concurrent_streams=max_concurrent_streams,
        ),
        (lambda: scheduler.view) if scheduler is not None else None,
    )


def params(key: str) -> GenerateParams:
    return GenerateParams(MODEL, "hello", (), Sampling(max_tokens=4), "interactive", key, 60)


async def test_tenants_without_a_stream_quota_get_the_default(
    admission: Admission, tiny_model_dir: Path
) -> None:
    tenant_id, _ = await admission.new_tenant_key("defaulted")
    gateway = direct_gateway(admission, tiny_model_dir, max_concurrent_streams=1)
    started = await gateway.start(tenant_id, params("first"))
    events = await gateway.follow(
        Principal(tenant_id), started.run_id, Position(0), False, known=started.stored
    )
    assert (await anext(events)).seq == 1
    with pytest.raises(QuotaExceeded) as refused:
        await gateway.follow(Principal(tenant_id), started.run_id, Position(0), False)
    assert refused.value.reason == "STREAMS_LIMITED"
    with pytest.raises(QuotaExceeded):
        await gateway.start(tenant_id, params("second"))
    assert await count_runs(admission) == 1
    await events.aclose()
    assert gateway.streams.num_open(tenant_id) == 0
    second = await gateway.follow(Principal(tenant_id), started.run_id, Position(0), False)
    assert (await anext(second)).seq == 1
    await second.aclose()
    await gateway.aclose()


async def test_quotas_carry_max_concurrent_streams(admission: Admission) -> None:
    admin = auth(ADMIN_TOKEN)
    tenant = await admission.admin.CreateTenant(
        admin_pb2.CreateTenantRequest(name="limited"), metadata=admin
    )
    # New tenants start with a finite concurrency, and the admission default for streams.
    assert tenant.quota.max_concurrent_runs == DEFAULT_MAX_CONCURRENT_RUNS
    assert not tenant.quota.HasField("max_concurrent_streams")
    await set_stream_quota(admission, tenant.tenant_id, 5)
    got = await admission.admin.GetTenant(
        admin_pb2.GetTenantRequest(tenant_id=tenant.tenant_id), metadata=admin
    )
    assert got.quota.max_concurrent_streams == 5
    await set_stream_quota(admission, tenant.tenant_id, 0)  # 0: unlimited, as every quota
    without = admin_pb2.Quota(tenant_id=tenant.tenant_id, max_concurrent_runs=3)
    reset = await admission.admin.SetQuota(admin_pb2.SetQuotaRequest(quota=without), metadata=admin)
    assert not reset.HasField("max_concurrent_streams") and reset.max_concurrent_runs == 3
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await set_stream_quota(admission, tenant.tenant_id, -1)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_tenant_holding_its_share_of_the_queue_waits_and_others_do_not(
    admission: Admission, tiny_model_dir: Path
) -> None:
    hog, _ = await admission.new_tenant_key("hog")
    other, _ = await admission.new_tenant_key("other")
    scheduler = Scheduler()
    gateway = direct_gateway(
        admission,
        tiny_model_dir,
        scheduler,
        max_queue_depth=10,
        tenant_share=0.2,
        min_tenant_share=1,
    )
    first = await gateway.start(hog, params("hog-1"))
    await gateway.start(hog, params("hog-2"))
    scheduler.view = FleetView(num_interactive=5)  # more than one tenant's share (2) of 10
    with pytest.raises(QuotaExceeded) as refused:
        await gateway.start(hog, params("hog-3"))
    assert "2 of this tenant's 2 queued runs" in str(refused.value)
    assert refused.value.subject == f"tenant:{hog}:queued_runs" and refused.value.retry_after
    assert (await gateway.start(hog, params("hog-1"))).run_id == first.run_id
    assert (await gateway.start(other, params("other-1"))).stored
    scheduler.view = FleetView(num_interactive=11)
    with pytest.raises(Unavailable):
        await gateway.start(other, params("other-2"))
    assert await count_runs(admission) == 3
    await gateway.aclose()


async def test_keys_of_the_wrong_shape_are_refused_without_a_query() -> None:
    # A database that is not there: a key looked up fails otherwise than Unauthenticated.
    db = open_db("postgresql://tollgate@127.0.0.1:1/nothing?connect_timeout=2")
    secret = "A" * 43
    wrong_shapes = [
        f"tg_0123456789ABCDEF_{secret}",  # key ids are lowercase hex
        f"tg_0123456789abcde\x00_{secret}",
        f"tg_0123456789abcdeé_{secret}",
        "tg_0123456789abcdef_short",
        f"tg_0123456789abcdef_{secret[:40]} ;--",
        f"tg_0123456789abcdef_{'a' * 5000}",
    ]
    try:
        for key in wrong_shapes:
            with pytest.raises(Unauthenticated):
                await authenticate(db, auth(key))
        with pytest.raises(DATABASE_AWAY):
            await authenticate(db, auth(f"tg_0123456789abcdef_{secret}"))
    finally:
        await db.dispose()


@contextlib.contextmanager
def held_still(failures: FailedAttempts) -> Iterator[None]:
    """The failure buckets' clock held still while the block runs: no token comes back
    between calls, however slow the machine makes them (two a second would)."""
    now = failures.clock()
    failures.clock = lambda: now
    try:
        yield
    finally:
        failures.clock = time.monotonic


async def test_a_peer_that_keeps_failing_is_held_back(admission: Admission) -> None:
    _, key = await admission.new_tenant_key("neighbour")
    wrong = auth("tg_0123456789abcdef_" + "x" * 43)
    with held_still(admission.core.auth_failures):
        for _ in range(FAILURE_BURST):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await admission.gateway.GetRun(
                    gateway_pb2.GetRunRequest(run_id="r"), metadata=wrong
                )
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await admission.gateway.ListRuns(gateway_pb2.ListRunsRequest(), metadata=auth(key))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    found = details(caught.value)
    assert found["ErrorInfo"].reason == "RATE_LIMITED"
    await asyncio.sleep(found["RetryInfo"].retry_delay.ToTimedelta().total_seconds())
    await admission.gateway.ListRuns(gateway_pb2.ListRunsRequest(), metadata=auth(key))


def batch_params(key: str) -> GenerateParams:
    return GenerateParams(MODEL, "hello", (), Sampling(max_tokens=4), "batch", key, 60)


async def test_an_overloaded_fleet_refuses_batch_runs_first(
    admission: Admission, tiny_model_dir: Path
) -> None:
    tenant, _ = await admission.new_tenant_key("degraded")
    scheduler = Scheduler()
    gateway = direct_gateway(
        admission, tiny_model_dir, scheduler, batch_kv_watermark=0.1, interactive_kv_watermark=-0.5
    )
    scheduler.view = FleetView(num_free_blocks=5, num_total_blocks=100)
    with pytest.raises(Unavailable) as refused:
        await gateway.start(tenant, batch_params("batch-1"))
    assert "batch watermark" in str(refused.value) and refused.value.retry_after > 0
    assert (await gateway.start(tenant, params("interactive-1"))).stored
    scheduler.view = FleetView(
        num_free_blocks=0, num_total_blocks=100, num_queued_interactive_blocks=60
    )
    with pytest.raises(Unavailable):
        await gateway.start(tenant, params("interactive-2"))
    scheduler.view = FleetView(num_free_blocks=90, num_total_blocks=100)
    assert (await gateway.start(tenant, batch_params("batch-1"))).stored
    assert await count_runs(admission) == 2
    await gateway.aclose()


async def test_guessing_the_admin_token_holds_the_peer_back_at_both_front_doors(
    admission: Admission,
) -> None:
    _, key = await admission.new_tenant_key("guessed-next-door")
    with held_still(admission.core.auth_failures):
        for _ in range(FAILURE_BURST):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await admission.admin.ListTenants(
                    admin_pb2.ListTenantsRequest(), metadata=auth("not-the-admin-token")
                )
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await admission.admin.ListTenants(
                admin_pb2.ListTenantsRequest(), metadata=auth(ADMIN_TOKEN)
            )
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert details(caught.value)["ErrorInfo"].reason == "RATE_LIMITED"
        # The HTTP door counts the same address in the same bucket, whatever its transport.
        app = create_app(admission.core)
        transport = httpx2.ASGITransport(app=app, client=("127.0.0.1", 1))
        async with httpx2.AsyncClient(transport=transport, base_url="http://admission") as http:
            answer = await http.get("/v1/models", headers={"authorization": f"Bearer {key}"})
    assert answer.status_code == 429 and "retry-after" in answer.headers


async def test_a_tenant_weight_past_the_bound_is_refused(admission: Admission) -> None:
    for weight in (MAX_TENANT_WEIGHT + 1, 2**31 - 1, -1):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await admission.admin.CreateTenant(
                admin_pb2.CreateTenantRequest(name=f"heavy{weight}", weight=weight),
                metadata=auth(ADMIN_TOKEN),
            )
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "weight" in (caught.value.details() or "")
    tenant = await admission.admin.CreateTenant(
        admin_pb2.CreateTenantRequest(name="heaviest", weight=MAX_TENANT_WEIGHT),
        metadata=auth(ADMIN_TOKEN),
    )
    assert tenant.weight == MAX_TENANT_WEIGHT
