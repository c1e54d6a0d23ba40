"""A run's whole life through four real processes, driven by the SDK."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.stack.flaky_link import FlakyLink
from services.stack.infra import Endpoints
from tests.e2e.conftest import INTERNAL, NUM_KV_BLOCKS, Stack, running_stack, stored_seqs
from tollgate import Client
from tollgate.errors import (
    IdempotencyKeyReusedError,
    InvalidArgumentError,
    NotFoundError,
    UnauthenticatedError,
)
from tollgate.v1 import worker_pb2, worker_pb2_grpc

MODEL = "tiny"


@pytest.fixture(scope="module", params=["builtin", "sim"])
def stack(
    request: pytest.FixtureRequest, infra: Endpoints, template_database: str, tiny_model_dir: Path
) -> Iterator[Stack]:
    """The suite runs on the built-in engine and again on the simulated one, the engine
    behind the worker being all that differs."""
    engine = {"TOLLGATE_ENGINE_KIND": request.param}
    with running_stack(infra, template_database, tiny_model_dir, engine) as (stack, _):
        yield stack


def wait_for_state(client: Client, run_id: str, states: set[str], timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = client.get_run(run_id).state
        if state in states:
            return state
        time.sleep(0.05)
    raise TimeoutError(f"run {run_id} never reached {states}")


def test_run_streams_to_completion_then_billed(stack: Stack) -> None:
    client = stack.tenant_client("acme")
    events = list(client.generate("hello toll gate", model=MODEL, max_tokens=24, temperature=0))
    kinds = [e.kind for e in events]
    assert kinds[:2] == ["queued", "prefill"] and kinds[-2:] == ["completed", "billed"]
    assert set(kinds[2:-2]) == {"streaming"}
    assert stored_seqs(events) == list(range(1, len(stored_seqs(events)) + 1))
    completed = events[-2]
    assert completed.usage is not None and completed.usage.output_tokens == sum(
        len(e.token_ids) for e in events
    )
    billed = events[-1]
    assert {e.billing_type for e in billed.entries} == {
        "input_tokens",
        "cached_input_tokens",
        "output_tokens",
    }
    assert billed.amount_micros == sum(e.amount_micros for e in billed.entries) > 0


def test_stream_run_replays_exactly_the_tail(stack: Stack) -> None:
    client = stack.tenant_client("acme")
    original = list(client.generate("replay me", model=MODEL, max_tokens=12, temperature=0))
    run_id = original[0].run_id
    stored = list(client.stream_run(run_id))  # the run has ended: nothing comes live
    assert not any(e.live for e in stored)
    assert "".join(e.text for e in stored) == "".join(e.text for e in original)
    last = stored[-1].seq
    for after in (0, 1, 2, last // 2, last - 1, last):
        tail = list(client.stream_run(run_id, starting_after=after))
        assert [(e.seq, e.kind, e.text) for e in tail] == [
            (e.seq, e.kind, e.text) for e in stored[after:]
        ]
    # From a token sent before it was stored: exactly the text after it.
    for i, event in enumerate(original):
        if event.live:
            tail = list(client.stream_run(run_id, starting_after=event.position))
            assert "".join(e.text for e in tail) == "".join(e.text for e in original[i + 1 :])


def test_a_broken_stream_resumes_without_repeats_or_gaps(stack: Stack) -> None:
    key = stack.tenant_key("resume")
    direct = stack.client(key)
    with FlakyLink(stack.gateway) as link:
        client = stack.client(key, link.address)
        events, tokens, cut_after = [], 0, [10, 150]  # tokens received before each cut
        for event in client.generate(
            "resume after a cut", model=MODEL, max_tokens=300, temperature=0, ignore_eos=True
        ):
            events.append(event)
            tokens += len(event.token_ids)
            if event.kind == "streaming" and cut_after and tokens >= cut_after[0]:
                cut_after.pop(0)
                link.cut()
    assert link.num_cuts == 2
    assert stored_seqs(events) == list(range(1, len(stored_seqs(events)) + 1))
    assert events[-1].kind == "billed"
    replay = list(direct.stream_run(events[0].run_id))
    assert "".join(e.text for e in events) == "".join(e.text for e in replay)
    assert sum(len(e.token_ids) for e in events) == 300


def test_idempotency_key_names_one_run_and_one_bill(stack: Stack) -> None:
    client = stack.tenant_client("idem")
    first = list(client.generate("same", model=MODEL, max_tokens=8, idempotency_key="order-42"))
    again = list(client.generate("same", model=MODEL, max_tokens=8, idempotency_key="order-42"))
    assert again[0].run_id == first[0].run_id
    assert stored_seqs(again) == stored_seqs(first)
    entries = list(client.iter_ledger_entries(run_id=first[0].run_id))
    assert Counter(e.billing_type for e in entries) == {
        "input_tokens": 1,
        "cached_input_tokens": 1,
        "output_tokens": 1,
    }
    with pytest.raises(IdempotencyKeyReusedError):
        list(client.generate("different", model=MODEL, max_tokens=8, idempotency_key="order-42"))


def test_cancel_while_queued_and_while_streaming(stack: Stack) -> None:
    client = stack.tenant_client("cancel")
    # The long run holds most of the worker's KV blocks, so the second one has to wait.
    long_run = client.generate("long", model=MODEL, max_tokens=1900, temperature=0, ignore_eos=True)
    long_events = iter(long_run)
    while next(long_events).kind != "streaming":
        pass
    waiting = client.generate("waits", model=MODEL, max_tokens=700, temperature=0, ignore_eos=True)
    waiting_first = next(iter(waiting))
    assert client.get_run(waiting_first.run_id).state == "queued"
    assert client.cancel_run(waiting_first.run_id).state in ("cancelled", "billed")
    assert client.cancel_run(waiting_first.run_id).state in ("cancelled", "billed")  # idempotent
    queued_tail = [e.kind for e in client.stream_run(waiting_first.run_id)]
    assert queued_tail == ["queued", "cancelled", "billed"]

    assert long_run.run_id is not None
    assert client.cancel_run(long_run.run_id).state in ("cancelled", "billed")
    rest = list(long_events)
    assert [e.kind for e in rest][-2:] == ["cancelled", "billed"]
    cancelled = rest[-2]
    delivered = sum(
        len(e.token_ids) for e in client.stream_run(long_run.run_id) if e.kind == "streaming"
    )
    assert cancelled.usage is not None and 0 < cancelled.usage.output_tokens < 1900
    assert cancelled.usage.output_tokens == delivered
    output_entry = next(e for e in rest[-1].entries if e.billing_type == "output_tokens")
    assert output_entry.quantity == delivered


def test_twenty_concurrent_runs_from_three_tenants_are_billed_once(stack: Stack) -> None:
    clients = [stack.tenant_client(f"t{i}") for i in range(3)]
    results: dict[int, list] = {}  # type: ignore[type-arg]

    def run(i: int) -> None:
        results[i] = list(
            clients[i % 3].generate(
                f"concurrent {i}",
                model=MODEL,
                max_tokens=16,
                priority="batch" if i % 2 else "interactive",
            )
        )

    threads = [threading.Thread(target=run, args=(i,)) for i in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(results) == 20
    for i, events in results.items():
        assert events[-1].kind == "billed", i
        assert stored_seqs(events) == list(range(1, len(stored_seqs(events)) + 1))
        entries = list(clients[i % 3].iter_ledger_entries(run_id=events[0].run_id))
        assert sorted(e.billing_type for e in entries) == [
            "cached_input_tokens",
            "input_tokens",
            "output_tokens",
        ]


def test_tenants_cannot_see_each_other(stack: Stack) -> None:
    a = stack.tenant_client("a")
    b = stack.tenant_client("b")
    run_id = list(a.generate("mine", model=MODEL, max_tokens=4))[0].run_id
    for call in (
        lambda: b.get_run(run_id),
        lambda: list(b.stream_run(run_id)),
        lambda: b.cancel_run(run_id),
    ):
        with pytest.raises(NotFoundError):
            call()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"model": "nope"}, "model"),
        ({"max_tokens": 0}, "sampling.max_tokens"),
        ({"max_tokens": 5000}, "sampling.max_tokens"),
        ({"temperature": -1.0}, "sampling.temperature"),
        ({"temperature": float("nan")}, "sampling.temperature"),
        ({"top_p": 0.0}, "sampling.top_p"),
        ({"top_p": 1.01}, "sampling.top_p"),
        ({"top_k": -2}, "sampling.top_k"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "x " * 9000}, "prompt"),
        ({"prompt": None, "messages": [("user", "y" * 70_000)]}, "messages[0].content"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_input_is_rejected_naming_the_field(
    stack: Stack, kwargs: dict[str, object], field: str
) -> None:
    client = stack.tenant_client("bad")
    arguments: dict[str, object] = {"prompt": "fine", "model": MODEL, "max_tokens": 8, **kwargs}
    with pytest.raises(InvalidArgumentError) as caught:
        list(client.generate(**arguments))  # type: ignore[arg-type]
    assert field in [v[0] for v in caught.value.field_violations]
    assert client.list_runs().runs == ()


def test_unknown_priority_is_invalid(stack: Stack) -> None:
    key = stack.tenant_key("prio")
    from tollgate.v1 import events_pb2, gateway_pb2_grpc

    stub = gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(stack.gateway))
    request = events_pb2.GenerateRequest(
        model=MODEL,
        prompt="p",
        priority=9,  # type: ignore[arg-type]
        sampling=events_pb2.SamplingParams(max_tokens=4),
    )
    with pytest.raises(grpc.RpcError) as caught:
        next(iter(stub.Generate(request, metadata=(("authorization", f"Bearer {key}"),))))
    assert (
        caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        and "priority" in caught.value.details()
    )


def test_wrong_or_missing_key_is_unauthenticated(stack: Stack) -> None:
    for key in ("tg_0123456789abcdef_wrong", "nonsense", ""):
        with pytest.raises(UnauthenticatedError):
            list(Client(stack.gateway, key).generate("x", model=MODEL, max_tokens=2))


def test_internal_services_refuse_calls_without_the_internal_token(stack: Stack) -> None:
    stub = worker_pb2_grpc.WorkerServiceStub(grpc.insecure_channel(stack.worker))
    with pytest.raises(grpc.RpcError) as refused:
        stub.GetWorkerStatus(worker_pb2.GetWorkerStatusRequest(), timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]


def test_zz_everything_is_released_afterwards(stack: Stack) -> None:
    """Runs last in this module: every reservation released, the worker's pool free."""
    stub = worker_pb2_grpc.WorkerServiceStub(grpc.insecure_channel(stack.worker))
    deadline = time.monotonic() + 30
    while True:
        status = stub.GetWorkerStatus(worker_pb2.GetWorkerStatusRequest(), metadata=INTERNAL)
        report = stack.admin.get_reconciliation()
        if (
            status.num_free_blocks == NUM_KV_BLOCKS and not status.running_run_ids and report.ok
        ) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert status.num_free_blocks == status.num_total_blocks == NUM_KV_BLOCKS
    assert list(status.running_run_ids) == []
    assert report.ok, report


def test_one_trace_follows_the_run_across_services(stack: Stack) -> None:
    import sqlalchemy as sa

    client = stack.tenant_client("trace")
    run_id = list(client.generate("trace me", model=MODEL, max_tokens=4))[0].run_id
    engine = sa.create_engine(stack.database_url)
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT kind, traceparent FROM run_events WHERE run_id = :r ORDER BY seq"),
            {"r": run_id},
        ).all()
    engine.dispose()
    trace_ids = {kind: traceparent.split("-")[1] for kind, traceparent in rows if traceparent}
    assert set(trace_ids) == {"queued", "prefill", "streaming", "completed", "billed"}
    assert len(set(trace_ids.values())) == 1


def test_services_expose_prometheus_metrics(stack: Stack) -> None:
    import urllib.request

    client = stack.tenant_client("metrics")
    list(client.generate("count me", model=MODEL, max_tokens=4))
    with pytest.raises(InvalidArgumentError):
        list(client.generate("bad", model=MODEL, max_tokens=0))
    worker = (
        urllib.request.urlopen(f"http://127.0.0.1:{stack.metrics['worker']}/metrics")
        .read()
        .decode()
    )
    for name in (
        "tollgate_time_to_first_token_seconds_bucket",
        "tollgate_inter_token_latency_seconds",
        "tollgate_generation_tokens_total",
        "tollgate_worker_kv_blocks",
    ):
        assert name in worker
    admission = (
        urllib.request.urlopen(f"http://127.0.0.1:{stack.metrics['admission']}/metrics")
        .read()
        .decode()
    )
    assert 'tollgate_rpc_rejections_total{code="INVALID_ARGUMENT",method="Generate"' in admission
    scheduler = (
        urllib.request.urlopen(f"http://127.0.0.1:{stack.metrics['scheduler']}/metrics")
        .read()
        .decode()
    )
    assert "tollgate_request_queue_time_seconds" in scheduler


def test_every_service_runs_on_uvloop(stack: Stack) -> None:
    for name in ("admission", "scheduler", "worker", "ledger"):
        lines = (stack.log_dir / f"{name}.log").read_text().splitlines()
        loops = [json.loads(line)["event_loop"] for line in lines if '"event": "running"' in line]
        assert loops and set(loops) == {"uvloop"}, name
