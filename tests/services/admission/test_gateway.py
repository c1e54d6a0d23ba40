import asyncio
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from services.admission.admit import Admission as NewAdmission
from services.admission.admit import Admitted, admit
from services.admission.backpressure import QueueBounds
from services.admission.cancel import Canceller
from services.admission.catalog import ModelCatalog
from services.admission.checks import Candidate
from services.admission.gateway import Gateway, GatewayConfig
from services.admission.requests import GenerateParams, Limits, Sampling
from services.admission.scheduler_client import hinted_run
from services.admission.stream import RunFeed
from services.core.errors import InvalidArgument, QuotaExceeded, Unavailable
from services.core.fleet import FleetView, WorkerLoad
from services.core.runs import RunState
from services.scheduler.scheduler_store import SchedulerStore
from services.scheduler.servicer import run_from_hint
from tests.services.admission.calls import count_runs, first_event, request, violations
from tests.services.admission.running import MODEL, Admission, auth
from tests.services.admission.worker_double import finish_run
from tollgate.v1 import events_pb2, gateway_pb2


async def read_rest(call) -> list[events_pb2.RunEvent]:  # type: ignore[no-untyped-def]
    events = []
    while (event := await call.read()) != grpc.aio.EOF:
        events.append(event)
    return events


async def test_generate_streams_every_event_until_billed(admission: Admission) -> None:
    _, key = await admission.new_tenant_key("acme")
    call = admission.gateway.Generate(request(), metadata=auth(key))
    queued = await call.read()
    assert queued.WhichOneof("kind") == "queued" and queued.seq == 1
    assert len(queued.queued.prompt_token_ids) > 0
    assert queued.queued.num_kv_blocks == math.ceil((len(queued.queued.prompt_token_ids) + 8) / 16)
    await finish_run(admission.store, queued.run_id, [5, 6, 7], ["a", "b", "c"])
    rest = await read_rest(call)
    kinds = [e.WhichOneof("kind") for e in rest]
    assert kinds == ["prefill", "streaming", "streaming", "streaming", "completed", "billed"]
    assert [e.seq for e in [queued, *rest]] == list(range(1, 8))
    assert "".join(e.streaming.text for e in rest) == "abc"


async def test_stream_run_returns_exactly_the_tail(admission: Admission) -> None:
    _, key = await admission.new_tenant_key("acme")
    queued = await first_event(
        admission, key, request(disconnect_grace=duration_pb2.Duration(seconds=60))
    )
    await finish_run(admission.store, queued.run_id, [1, 2, 3, 4], ["w", "x", "y", "z"])
    for after in (0, 1, 3, 6, 8):
        stream = admission.gateway.StreamRun(
            gateway_pb2.StreamRunRequest(run_id=queued.run_id, starting_after=after),
            metadata=auth(key),
        )
        assert [e.seq async for e in stream] == list(range(after + 1, 9))


async def test_live_switch_has_no_gap_or_repeat(admission: Admission) -> None:
    _, key = await admission.new_tenant_key("acme")
    queued = await first_event(
        admission, key, request(disconnect_grace=duration_pb2.Duration(seconds=60))
    )
    stream = admission.gateway.StreamRun(
        gateway_pb2.StreamRunRequest(run_id=queued.run_id, starting_after=0, until_terminal=True),
        metadata=auth(key),
    )
    assert (await stream.read()).seq == 1
    writer = asyncio.create_task(
        finish_run(admission.store, queued.run_id, list(range(40)), ["t"] * 40)
    )
    seqs = [1] + [e.seq for e in await read_rest(stream)]
    await writer
    assert seqs == list(range(1, 44))  # through `completed`, seq 43


async def test_same_idempotency_key_attaches_to_the_same_run(admission: Admission) -> None:
    _, key = await admission.new_tenant_key("acme")
    grace = duration_pb2.Duration(seconds=60)
    first = await first_event(
        admission, key, request(idempotency_key="k-1", disconnect_grace=grace)
    )
    again = await first_event(
        admission, key, request(idempotency_key="k-1", disconnect_grace=grace)
    )
    assert again.run_id == first.run_id and again.seq == 1
    assert await count_runs(admission) == 1
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await first_event(admission, key, request(idempotency_key="k-1", prompt="something else"))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    status = rpc_status.from_call(caught.value)  # type: ignore[arg-type]
    info = error_details_pb2.ErrorInfo()
    assert status is not None and status.details[0].Unpack(info)
    assert info.reason == "IDEMPOTENCY_KEY_REUSED" and info.metadata["run_id"] == first.run_id


async def test_concurrent_submissions_with_one_key_make_one_run(admission: Admission) -> None:
    _, key = await admission.new_tenant_key("acme")
    req = request(idempotency_key="race", disconnect_grace=duration_pb2.Duration(seconds=60))
    events = await asyncio.gather(*(first_event(admission, key, req) for _ in range(8)))
    assert len({e.run_id for e in events}) == 1
    assert await count_runs(admission) == 1


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"model": "nope"}, "model"),
        ({"sampling_max_tokens": 0}, "sampling.max_tokens"),
        ({"sampling_max_tokens": -3}, "sampling.max_tokens"),
        ({"sampling_max_tokens": 100_000}, "sampling.max_tokens"),
        ({"sampling_temperature": -0.5}, "sampling.temperature"),
        ({"sampling_temperature": float("nan")}, "sampling.temperature"),
        ({"sampling_top_p": 0.0}, "sampling.top_p"),
        ({"sampling_top_p": 1.5}, "sampling.top_p"),
        ({"sampling_top_k": -1}, "sampling.top_k"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "x" * 3000}, "prompt"),
        ({"priority": 7}, "priority"),
    ],
    ids=lambda v: str(v) if isinstance(v, str) else None,
)
async def test_bad_input_names_the_field_and_creates_no_run(
    admission: Admission, overrides: dict[str, object], field: str
) -> None:
    _, key = await admission.new_tenant_key("acme")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await first_event(admission, key, request(**overrides))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in violations(caught.value)
    assert field in (caught.value.details() or "")
    assert await count_runs(admission) == 0


async def test_oversized_message_and_context_length(admission: Admission, tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    _, key = await admission.new_tenant_key("acme")
    big = events_pb2.GenerateRequest(
        model=MODEL,
        messages=[events_pb2.ChatMessage(role="user", content="y" * 2500)],
        sampling=events_pb2.SamplingParams(max_tokens=4),
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await first_event(admission, key, big)
    assert violations(caught.value) == ["messages[0].content"]
    # Context length: the gateway's catalog says how long the model's context is.
    checks = direct_gateway(admission, tiny_model_dir).checks
    long_prompt = params("long")
    tokens = NewAdmission("run_long", "t", long_prompt, [1] * 9000, 1)
    refused = await checks.context_length(Candidate("t", "", long_prompt, tokens))
    assert isinstance(refused, InvalidArgument)
    assert [v.field for v in refused.violations] == ["prompt"]
    assert "exceed the context length of 8192" in refused.violations[0].description
    assert await count_runs(admission) == 0


async def test_wrong_or_missing_key_is_unauthenticated(admission: Admission) -> None:
    for metadata in (auth("tg_0000000000000000_nope"), auth("garbage"), ()):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await first_event(
                admission, "", request()
            ) if not metadata else await admission.gateway.GetRun(
                gateway_pb2.GetRunRequest(run_id="x"), metadata=metadata
            )
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_other_tenants_runs_do_not_exist(admission: Admission) -> None:
    _, key_a = await admission.new_tenant_key("a")
    _, key_b = await admission.new_tenant_key("b")
    run_id = (
        await first_event(
            admission, key_a, request(disconnect_grace=duration_pb2.Duration(seconds=60))
        )
    ).run_id
    calls = [
        admission.gateway.GetRun(gateway_pb2.GetRunRequest(run_id=run_id), metadata=auth(key_b)),
        admission.gateway.CancelRun(
            gateway_pb2.CancelRunRequest(run_id=run_id), metadata=auth(key_b)
        ),
    ]
    for call in calls:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    stream = admission.gateway.StreamRun(
        gateway_pb2.StreamRunRequest(run_id=run_id), metadata=auth(key_b)
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stream.read()
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    listed = await admission.gateway.ListRuns(gateway_pb2.ListRunsRequest(), metadata=auth(key_b))
    assert list(listed.runs) == []
    run = await admission.gateway.GetRun(
        gateway_pb2.GetRunRequest(run_id=run_id), metadata=auth(key_a)
    )
    assert run.state == events_pb2.RUN_STATE_QUEUED


async def test_cancel_while_queued_is_idempotent(admission: Admission) -> None:
    _, key = await admission.new_tenant_key("acme")
    run_id = (
        await first_event(
            admission, key, request(disconnect_grace=duration_pb2.Duration(seconds=60))
        )
    ).run_id
    for _ in range(2):
        run = await admission.gateway.CancelRun(
            gateway_pb2.CancelRunRequest(run_id=run_id), metadata=auth(key)
        )
        assert run.state == events_pb2.RUN_STATE_CANCELLED
    kinds = [e.kind for e in await admission.store.read(run_id)]
    assert kinds == ["queued", "cancelled"]


async def test_disconnect_without_grace_cancels_the_run(admission: Admission) -> None:
    _, key = await admission.new_tenant_key("acme")
    run_id = (
        await first_event(
            admission, key, request(disconnect_grace=duration_pb2.Duration(seconds=0))
        )
    ).run_id

    async def cancelled() -> bool:
        run = await admission.store.get_run(run_id)
        return run is not None and run.state == "cancelled"

    for _ in range(100):
        if await cancelled():
            break
        await asyncio.sleep(0.05)
    assert await cancelled()


async def test_an_attached_stream_keeps_the_run_alive(admission: Admission) -> None:
    _, key = await admission.new_tenant_key("acme")
    req = request(disconnect_grace=duration_pb2.Duration(nanos=300_000_000))
    call = admission.gateway.Generate(req, metadata=auth(key))
    run_id = (await call.read()).run_id
    resumed = admission.gateway.StreamRun(
        gateway_pb2.StreamRunRequest(run_id=run_id), metadata=auth(key)
    )
    assert (await resumed.read()).seq == 1
    call.cancel()
    await asyncio.sleep(1.0)
    run = await admission.store.get_run(run_id)
    assert run is not None and run.state == "queued"
    resumed.cancel()


async def test_kv_quota_is_enforced(admission: Admission) -> None:
    tenant_id, key = await admission.new_tenant_key("small")
    await admission.tenants.set_quota(tenant_id, max_kv_blocks=2, max_concurrent_runs=0)
    grace = duration_pb2.Duration(seconds=60)
    await first_event(admission, key, request(disconnect_grace=grace))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await first_event(admission, key, request(disconnect_grace=grace, prompt="again"))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    status = rpc_status.from_call(caught.value)  # type: ignore[arg-type]
    assert status is not None
    assert {d.TypeName() for d in status.details} >= {
        "google.rpc.QuotaFailure",
        "google.rpc.RetryInfo",
    }
    assert await count_runs(admission) == 1


async def test_concurrent_admissions_never_exceed_the_quotas(
    admission: Admission, tiny_model_dir: Path
) -> None:
    tenant_id, _ = await admission.new_tenant_key("busy")
    await admission.tenants.set_quota(tenant_id, max_kv_blocks=0, max_concurrent_runs=3)
    checks = direct_gateway(admission, tiny_model_dir).checks

    async def one(i: int) -> str:
        params = GenerateParams(
            MODEL, f"run {i}", (), Sampling(max_tokens=4), "interactive", "", 60
        )
        new = NewAdmission(f"run_{i:032d}", tenant_id, params, [1, 2], 1)
        run = Candidate(tenant_id, "", params, new)
        try:
            await admit(
                admission.db,
                new,
                lambda held: checks.first_refusal(checks.on_hold, replace(run, held=held)),
            )
        except QuotaExceeded as refused:
            return str(refused)
        return "admitted"

    outcomes = await asyncio.gather(*(one(i) for i in range(16)))
    assert outcomes.count("admitted") == 3
    assert all("concurrency quota: 3 of 3" in o for o in outcomes if o != "admitted")
    assert await count_runs(admission) == 3


def direct_gateway(admission: Admission, model_dir: Path, **options: Any) -> Gateway:
    """A Gateway on the test's database, called directly rather than through gRPC."""
    return Gateway(
        admission.db,
        ModelCatalog.load({MODEL: str(model_dir)}),
        RunFeed(admission.store.db.url.render_as_string(hide_password=False)),
        Canceller(admission.store, None),
        GatewayConfig(
            limits=Limits(max_tokens=512, max_message_chars=2000),
            queue=QueueBounds(max_queue_depth=3),
        ),
        **options,
    )


def params(key: str) -> GenerateParams:
    return GenerateParams(MODEL, "hello", (), Sampling(max_tokens=4), "interactive", key, 60)


async def test_the_scheduler_hears_of_each_new_run_once(
    admission: Admission, tiny_model_dir: Path
) -> None:
    tenant = await admission.tenants.create("hinted", 3)
    hinted: list[Admitted] = []
    gateway = direct_gateway(admission, tiny_model_dir, on_queued=hinted.append)
    started = await gateway.start(tenant.tenant_id, params("once"))
    again = await gateway.start(tenant.tenant_id, params("once"))
    run_id = started.run_id
    assert again.run_id == run_id and again.stored == ()
    assert [event.kind for event in started.stored] == [RunState.QUEUED]
    [admitted] = hinted
    # The scheduler queues the hinted run as it would read it from the store; only the
    # creation time is its `queued` event's, a statement later than the projection row's.
    scheduler_store = SchedulerStore(admission.db, block_size=16)
    [stored] = await scheduler_store.load_queued([run_id])
    from_hint = run_from_hint(hinted_run(admitted), 16)
    assert 0 <= from_hint.created_at - stored.created_at < 1.0
    assert replace(from_hint, created_at=stored.created_at) == stored
    assert stored.weight == 3 and stored.num_kv_blocks > 0 and stored.prompt_token_ids


async def test_a_full_queue_refuses_new_runs_but_attaches_a_known_key(
    admission: Admission, tiny_model_dir: Path
) -> None:
    tenant_id, _ = await admission.new_tenant_key("queued-up")
    view = FleetView()
    gateway = direct_gateway(admission, tiny_model_dir, fleet=lambda: view)
    run_id = (await gateway.start(tenant_id, params("first"))).run_id
    view = FleetView(num_batch=4)
    with pytest.raises(Unavailable):
        await gateway.start(tenant_id, params("second"))
    assert (await gateway.start(tenant_id, params("first"))).run_id == run_id
    assert await count_runs(admission) == 1


async def test_a_run_larger_than_every_live_pool_for_its_model_is_refused(
    admission: Admission, tiny_model_dir: Path
) -> None:
    tenant_id, _ = await admission.new_tenant_key("fleet")
    view = FleetView(max_run_tokens={MODEL: 40})
    gateway = direct_gateway(admission, tiny_model_dir, fleet=lambda: view)
    large = GenerateParams(MODEL, "hello", (), Sampling(max_tokens=39), "interactive", "l", 60)
    with pytest.raises(InvalidArgument) as refused:
        await gateway.start(tenant_id, large)
    assert [v.field for v in refused.value.violations] == ["sampling.max_tokens"]
    assert "40 tokens the largest worker serving" in str(refused.value.violations[0].description)
    await gateway.start(tenant_id, params("small"))  # 4 tokens fit
    view = FleetView()  # the fleet's pools unknown: nothing is refused for them
    await gateway.start(tenant_id, large)
    assert await count_runs(admission) == 2


async def test_a_parameter_no_engine_of_the_model_honours_is_refused_naming_it(
    admission: Admission, tiny_model_dir: Path
) -> None:
    tenant_id, _ = await admission.new_tenant_key("engines")

    def worker(kind: str, alive: bool = True) -> WorkerLoad:
        return WorkerLoad(f"w-{kind}", MODEL, 10, 10, 0, alive, False, False, kind)

    view = FleetView(workers=(worker("openai"), worker("vllm", alive=False)))
    gateway = direct_gateway(admission, tiny_model_dir, fleet=lambda: view)
    top_k = GenerateParams(
        MODEL, "hello", (), Sampling(max_tokens=4, top_k=5), "interactive", "k", 60
    )
    with pytest.raises(InvalidArgument) as refused:
        await gateway.start(tenant_id, top_k)
    [violation] = refused.value.violations
    assert violation.field == "sampling.top_k" and "no top_k" in violation.description
    await gateway.start(tenant_id, params("plain"))  # nothing unusual: admitted
    view = FleetView(workers=(worker("openai"), worker("vllm")))  # one live engine honours it
    await gateway.start(tenant_id, top_k)
    assert await count_runs(admission) == 2


async def test_list_runs_pages_through_everything(admission: Admission) -> None:
    _, key = await admission.new_tenant_key("acme")
    grace = duration_pb2.Duration(seconds=60)
    made = {
        (await first_event(admission, key, request(prompt=f"p{i}", disconnect_grace=grace))).run_id
        for i in range(7)
    }
    seen, token = [], ""
    while True:
        page = await admission.gateway.ListRuns(
            gateway_pb2.ListRunsRequest(page_size=3, page_token=token), metadata=auth(key)
        )
        seen += [r.run_id for r in page.runs]
        token = page.next_page_token
        if not token:
            break
    assert len(seen) == 7 and set(seen) == made
