"""Arbitrary requests of every public type, against the real admission and ledger servicers
on the real PostgreSQL: never INTERNAL, UNKNOWN or a retryable UNAVAILABLE, never a run
stored for a refused request, and a normal run is still admitted, published and billed.

TOLLGATE_PROPERTY_EXAMPLES sets the number of requests per type (2,000 by default; requests
without fields have only a handful).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import sqlalchemy as sa
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.core.config import CommonSettings
from services.core.pricing import PriceTable
from services.ledger.app import LedgerSettings, create_ledger_server
from services.ledger.sweep import Sweeper
from tests.services.admission.calls import request, violations
from tests.services.admission.running import ADMIN_TOKEN, MODEL, Admission, auth, running_admission
from tests.services.admission.worker_double import complete_run, finish_run
from tests.services.core.kafka_tools import read_topic
from tests.services.public_requests import TALLY, is_field_path, requests
from tollgate.v1 import admin_pb2, events_pb2, gateway_pb2, ledger_pb2, ledger_pb2_grpc

EXAMPLES = int(os.environ.get("TOLLGATE_PROPERTY_EXAMPLES", "2000"))
NEVER = {
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DATA_LOSS,
}
SERVICES = {
    "gateway": gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"],
    "admin": admin_pb2.DESCRIPTOR.services_by_name["AdminService"],
    "ledger": ledger_pb2.DESCRIPTOR.services_by_name["LedgerService"],
}
# The operators' service with the slow cases: the tenants' calls in every run of the suite.
METHODS = [
    pytest.param(service, m, marks=[pytest.mark.slow] if service == "admin" else [])
    for service, d in SERVICES.items()
    for m in d.methods
]
MAX_RECEIVE = 16 * 1024 * 1024  # services.core.server's grpc.max_receive_message_length
PRICES = PriceTable({"*": {"input_tokens": 2, "cached_input_tokens": 1, "output_tokens": 8}})


@dataclass
class Surface:
    admission: Admission
    ledger: ledger_pb2_grpc.LedgerServiceStub
    kafka: tuple[str, str]
    tenant_id: str
    key: str
    other_tenant_id: str
    other_key_id: str
    known_run_ids: list[str]
    admitted: set[str] = field(default_factory=set)

    def hints(self, service: str) -> dict[str, st.SearchStrategy[Any]]:
        """Values that reach past the lookups; the admin ones touch only the other tenant,
        so this one's key and quotas stay as they are."""
        tenants = [self.other_tenant_id] + ([self.tenant_id] if service == "ledger" else [])
        return {
            "model": st.just(MODEL),
            "prompt": st.one_of(st.just(""), st.text(max_size=40)),
            "role": st.sampled_from(["system", "user", "assistant", "tool"]),
            "content": st.text(max_size=40),
            "max_tokens": st.integers(1, 16),
            "temperature": st.floats(0, 2, width=32),
            "top_p": st.floats(0.125, 1, width=32),
            "top_k": st.integers(0, 50),
            "stop": st.text(min_size=1, max_size=5),
            "stop_token_ids": st.integers(0, 100),
            "priority": st.sampled_from([0, 1, 2]),
            "idempotency_key": st.sampled_from(["", "", "same", "known-0"]),
            # Durations (disconnect_grace) and timestamps (the usage period) in range.
            "seconds": st.integers(0, 3600),
            "nanos": st.integers(0, 999_999_999),
            "run_id": st.sampled_from(self.known_run_ids),
            "starting_after": st.integers(0, 12),
            "page_size": st.integers(0, 20),
            "tenant_id": st.sampled_from(tenants),
            "key_id": st.just(self.other_key_id),
            "name": st.text(min_size=1, max_size=30),
            "weight": st.integers(0, 10),
        }


@pytest.fixture
async def surface(
    database_url: str, kafka_bootstrap: str, kafka_topic: str, tiny_model_dir: Path
) -> AsyncIterator[Surface]:
    async with (
        running_admission(database_url, kafka_bootstrap, kafka_topic, tiny_model_dir) as admission,
        running_ledger(admission) as ledger,
    ):
        tenant_id, key = await admission.new_tenant_key("prop")
        other = await admission.tenants.create("other", 1)
        other_key = await admission.tenants.create_key(other.tenant_id)
        known = [await billed_run(admission, key, f"known-{i}") for i in range(2)]
        yield Surface(
            admission,
            ledger,
            (kafka_bootstrap, kafka_topic),
            tenant_id,
            key,
            other.tenant_id,
            other_key.key_id,
            known,
        )


@contextlib.asynccontextmanager
async def running_ledger(admission: Admission) -> AsyncIterator[ledger_pb2_grpc.LedgerServiceStub]:
    common = CommonSettings("unused", "unused:0", "unused", "127.0.0.1:0")
    settings = LedgerSettings(common, ADMIN_TOKEN, PRICES, sweep_interval=5, sweep_grace=10)
    server, port, _ = create_ledger_server(admission.db, settings)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield ledger_pb2_grpc.LedgerServiceStub(channel)
    finally:
        await server.stop(None)


async def billed_run(admission: Admission, key: str, idempotency_key: str) -> str:
    """A run that went all the way, so that streams of it end at once."""
    call = admission.gateway.Generate(request(idempotency_key=idempotency_key), metadata=auth(key))
    queued = await call.read()
    await finish_run(admission.store, queued.run_id, [5], ["a"])
    while await call.read() != grpc.aio.EOF:
        pass
    return queued.run_id


def stub_of(surface: Surface, service: str, method: MethodDescriptor) -> Callable[..., Any]:
    stubs: dict[str, Any] = {
        "gateway": surface.admission.gateway,
        "admin": surface.admission.admin,
        "ledger": surface.ledger,
    }
    return getattr(stubs[service], method.name)  # type: ignore[no-any-return]


async def send(
    stub: Callable[..., Any], message: Message, metadata: Any, streaming: bool
) -> tuple[grpc.StatusCode, Any]:
    """The call's status code, and its first event (streams) or reply or error."""
    try:
        if not streaming:
            return grpc.StatusCode.OK, await stub(message, metadata=metadata, timeout=30)
        call = stub(message, metadata=metadata)
        try:
            return grpc.StatusCode.OK, await asyncio.wait_for(call.read(), 30)
        finally:
            call.cancel()
    except grpc.aio.AioRpcError as error:
        return error.code(), error


@pytest.mark.parametrize(("service", "method"), METHODS, ids=lambda v: getattr(v, "name", v))
async def test_no_request_is_an_internal_error_or_stores_a_refused_run(
    surface: Surface, service: str, method: MethodDescriptor
) -> None:
    loop = asyncio.get_running_loop()
    stub = stub_of(surface, service, method)
    strategy = requests(method.input_type, surface.hints(service))
    tally = TALLY.setdefault(method.name, Counter())

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(message=strategy, as_admin=st.booleans())
    def examples(message: Message, as_admin: bool) -> None:
        token = ADMIN_TOKEN if service == "admin" or (service == "ledger" and as_admin) else None
        metadata = auth(token or surface.key)
        sent = send(stub, message, metadata, method.server_streaming)
        code, answer = asyncio.run_coroutine_threadsafe(sent, loop).result(timeout=60)
        tally[code.name] += 1
        assert code not in NEVER, f"{method.name}({message!r:.300}) -> {answer!r:.300}"
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            # No quota binds this tenant: only gRPC's own limit on what a server receives.
            assert message.ByteSize() > MAX_RECEIVE, answer
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            fields = violations(answer)
            assert fields and all(is_field_path(method.input_type, f) for f in fields), fields
        if method.name == "Generate" and code == grpc.StatusCode.OK and answer is not grpc.aio.EOF:
            surface.admitted.add(answer.run_id)

    await asyncio.to_thread(examples)
    async with surface.admission.db.connect() as conn:
        stored = set((await conn.scalars(sa.text("SELECT run_id FROM runs"))).all())
    assert stored == set(surface.known_run_ids) | surface.admitted
    await a_normal_run_is_admitted_published_and_billed(surface)


async def a_normal_run_is_admitted_published_and_billed(surface: Surface) -> None:
    admission = surface.admission
    call = admission.gateway.Generate(request(), metadata=auth(surface.key))
    queued = await call.read()
    await complete_run(admission.store, queued.run_id, [5, 6], ["a", "b"])
    assert await Sweeper(admission.db, PRICES, grace=0).bill_one(queued.run_id)
    kinds = []
    while (event := await call.read()) != grpc.aio.EOF:
        kinds.append(event.WhichOneof("kind"))
    assert kinds[-1] == "billed"
    entries = await surface.ledger.ListLedgerEntries(
        ledger_pb2.ListLedgerEntriesRequest(run_id=queued.run_id), metadata=auth(surface.key)
    )
    assert {e.billing_type for e in entries.entries} >= {"input_tokens", "output_tokens"}
    bootstrap, topic = surface.kafka
    async with admission.db.connect() as conn:
        num_events = int(await conn.scalar(sa.text("SELECT count(*) FROM run_events")) or 0)
    records = await read_topic(bootstrap, topic, min_records=num_events, timeout=30)
    published = {
        events_pb2.RunEvent.FromString(r.value).seq
        for r in records
        if r.key == queued.run_id.encode()
    }
    assert published == set(range(1, 2 + len(kinds)))  # queued, then what the stream read
