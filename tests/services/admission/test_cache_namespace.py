"""A run's prefix-cache namespace is its tenant's, whatever the client sends: admission
derives the tenant from the API key alone, and the scheduler and the worker take the
namespace from what admission stored, so no client can reach another tenant's KV blocks."""

from __future__ import annotations

import json

from google.protobuf import timestamp_pb2

from services.scheduler.fair_queue import QueueClass
from services.scheduler.records import QueuedRun
from services.scheduler.scheduler_store import SchedulerStore
from services.scheduler.servicer import run_from_hint
from services.scheduler.worker_client import Grant, assign_request
from services.worker.servicer import assignment_from_proto
from tests.services.admission.calls import request
from tests.services.admission.running import Admission, auth
from tollgate.v1 import events_pb2, scheduler_pb2

VICTIM = "tenant_of_someone_else"
GATEWAY_GENERATE = "/tollgate.v1.GatewayService/Generate"


def unknown_fields(value: str) -> bytes:
    """Length-delimited fields 90..110, which GenerateRequest does not define: whatever a
    newer or hostile client might name `cache_namespace` or `tenant_id`."""
    data = value.encode()
    out = b""
    for number in range(90, 111):
        tag = number << 3 | 2
        out += bytes([tag & 0x7F | 0x80, tag >> 7]) + bytes([len(data)]) + data
    return out


def namespace_of(run: QueuedRun) -> str:
    """What the worker keys the run's prefix cache by, from what the scheduler sends it."""
    assign = assign_request(run, Grant(lease_epoch=1, last_seq=run.last_seq))
    # What the scheduler puts on the wire is what the worker reads.
    wire = type(assign).FromString(assign.SerializeToString())
    return assignment_from_proto(wire).cache_namespace


async def test_a_client_cannot_choose_its_runs_cache_namespace(admission: Admission) -> None:
    tenant_id, key = await admission.new_tenant_key("namespaced")
    await admission.new_tenant_key(VICTIM)
    generate = admission.channel.unary_stream(
        GATEWAY_GENERATE,
        request_serializer=lambda m: m.SerializeToString() + unknown_fields(VICTIM),
        response_deserializer=events_pb2.RunEvent.FromString,
    )
    call = generate(request(prompt="namespace me"), metadata=auth(key))
    queued = await call.read()
    call.cancel()
    assert isinstance(queued, events_pb2.RunEvent) and queued.tenant_id == tenant_id
    [run] = await SchedulerStore(admission.db).load_queued([queued.run_id])
    assert run.tenant_id == tenant_id
    assert VICTIM not in json.dumps(dict(run.payload))
    assert namespace_of(run) == tenant_id


def test_the_queued_payload_cannot_name_another_namespace() -> None:
    """Even a `queued` payload that carried such fields (admission writes none) is not
    read for the namespace: the run's tenant is."""
    payload = {
        "prompt_token_ids": [1, 2, 3],
        "sampling": {"max_tokens": 4},
        "cache_namespace": VICTIM,
        "tenant_id": VICTIM,
    }
    run = QueuedRun(
        run_id="run_1",
        tenant_id="tenant_a",
        model="tiny",
        queue_class=QueueClass.INTERACTIVE,
        last_seq=1,
        payload=payload,
        traceparent="",
        created_at=0.0,
        queued_at=0.0,
        weight=1,
        num_kv_blocks=1,
    )
    assert namespace_of(run) == "tenant_a"
    hint = scheduler_pb2.HintedRun(
        run_id="run_1",
        tenant_id="tenant_a",
        model="tiny",
        priority="interactive",
        last_seq=1,
        queued_payload_json=json.dumps(payload),
        queued_at=timestamp_pb2.Timestamp(seconds=1),
    )
    assert namespace_of(run_from_hint(hint, block_size=16)) == "tenant_a"
