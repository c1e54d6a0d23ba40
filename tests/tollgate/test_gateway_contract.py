"""FakeGateway answers as the real GatewayServicer does, on what the SDK and CLI rely on.

`GatewayContractTests` talks to a GatewayService through its stub only; one subclass runs
it against FakeGateway, the other against the real servicer on PostgreSQL, with the
worker double playing worker and ledger. The fake's scripted breaks (`breaks`,
`generate_error`, `end`) are extras for the resume tests, not part of the contract.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from google.protobuf import duration_pb2

from tests.services.admission.running import auth, running_admission
from tests.services.admission.worker_double import finish_run
from tests.tollgate.contract import refusal
from tests.tollgate.fake_gateway import start_fake
from tollgate.v1 import events_pb2, gateway_pb2, gateway_pb2_grpc

STATES = {
    "queued": events_pb2.RUN_STATE_QUEUED,
    "prefill": events_pb2.RUN_STATE_PREFILL,
    "streaming": events_pb2.RUN_STATE_STREAMING,
    "completed": events_pb2.RUN_STATE_COMPLETED,
    "billed": events_pb2.RUN_STATE_BILLED,
}


@dataclass
class GatewaySide:
    stub: gateway_pb2_grpc.GatewayServiceStub
    metadata: tuple[tuple[str, str], ...]
    # Has the worker and the ledger take a queued run to `completed`, then `billed`.
    finish: Callable[[str], Awaitable[None]]


def generate_request(**fields: object) -> events_pb2.GenerateRequest:
    request = events_pb2.GenerateRequest(
        model="tiny",
        prompt="hello toll gate",
        sampling=events_pb2.SamplingParams(max_tokens=8),
        disconnect_grace=duration_pb2.Duration(seconds=60),  # leaving early cancels nothing
    )
    for name, value in fields.items():
        setattr(request, name, value)
    return request


async def read_all(call: grpc.aio.UnaryStreamCall) -> list[events_pb2.RunEvent]:  # type: ignore[type-arg]
    events = []
    while (event := await call.read()) != grpc.aio.EOF:
        events.append(event)
    return events


class GatewayContractTests:
    """Subclasses provide a `gateway` fixture: a GatewaySide with a tenant's key."""

    async def generate(
        self, gateway: GatewaySide, request: events_pb2.GenerateRequest | None = None
    ) -> list[events_pb2.RunEvent]:
        """Every event of a run that completes."""
        call = gateway.stub.Generate(request or generate_request(), metadata=gateway.metadata)
        queued = await call.read()
        await gateway.finish(queued.run_id)
        return [queued, *await read_all(call)]

    async def start(self, gateway: GatewaySide, **fields: object) -> events_pb2.RunEvent:
        """The first event of a new run, which then goes on without a reader."""
        call = gateway.stub.Generate(generate_request(**fields), metadata=gateway.metadata)
        queued = await call.read()
        call.cancel()
        return queued

    async def test_a_completed_run_streams_queued_to_billed_without_gaps(
        self, gateway: GatewaySide
    ) -> None:
        events = await self.generate(gateway)
        kinds = [e.WhichOneof("kind") for e in events]
        assert [e.seq for e in events] == list(range(1, len(events) + 1))
        assert kinds[:2] == ["queued", "prefill"] and kinds[-2:] == ["completed", "billed"]
        assert set(kinds[2:-2]) == {"streaming"}
        assert len({e.run_id for e in events}) == len({e.tenant_id for e in events}) == 1
        assert all(e.tenant_id and e.state == STATES[k] for e, k in zip(events, kinds, strict=True))
        assert all(e.HasField("time") for e in events)
        queued, completed, billed = events[0].queued, events[-2].completed, events[-1].billed
        assert queued.model == "tiny" and queued.prompt_token_ids
        assert events[1].prefill.worker_id
        streamed = [t for e in events[2:-2] for t in e.streaming.token_ids]
        assert completed.usage.output_tokens == len(streamed) > 0
        assert completed.usage.prompt_tokens == len(queued.prompt_token_ids)
        assert completed.finish_reason and billed.currency

    async def test_until_terminal_ends_the_stream_with_the_terminal_event(
        self, gateway: GatewaySide
    ) -> None:
        events = await self.generate(gateway, generate_request(until_terminal=True))
        assert [e.WhichOneof("kind") for e in events][-1] == "completed"

    async def test_stream_run_sends_exactly_the_events_after_starting_after(
        self, gateway: GatewaySide
    ) -> None:
        events = await self.generate(gateway)
        run_id, last = events[0].run_id, len(events)
        for after in (0, 1, last - 1, last):
            stream = gateway.stub.StreamRun(
                gateway_pb2.StreamRunRequest(run_id=run_id, starting_after=after),
                metadata=gateway.metadata,
            )
            assert [e.seq async for e in stream] == list(range(after + 1, last + 1))

    async def test_an_unknown_run_is_not_found(self, gateway: GatewaySide) -> None:
        stub, metadata = gateway.stub, gateway.metadata
        stream = stub.StreamRun(gateway_pb2.StreamRunRequest(run_id="nope"), metadata=metadata)
        for call in (
            stream.read(),
            stub.GetRun(gateway_pb2.GetRunRequest(run_id="nope"), metadata=metadata),
            stub.CancelRun(gateway_pb2.CancelRunRequest(run_id="nope"), metadata=metadata),
        ):
            assert (await refusal(call))[0] == grpc.StatusCode.NOT_FOUND

    async def test_get_run_sums_up_the_runs_events(self, gateway: GatewaySide) -> None:
        events = await self.generate(gateway, generate_request(idempotency_key="sum-up"))
        run = await gateway.stub.GetRun(
            gateway_pb2.GetRunRequest(run_id=events[0].run_id), metadata=gateway.metadata
        )
        completed = events[-2].completed
        assert (run.run_id, run.tenant_id) == (events[0].run_id, events[0].tenant_id)
        assert (run.model, run.idempotency_key) == ("tiny", "sum-up")
        assert (run.state, run.last_seq) == (events_pb2.RUN_STATE_BILLED, len(events))
        assert (run.usage, run.finish_reason) == (completed.usage, completed.finish_reason)
        assert run.priority == events_pb2.PRIORITY_INTERACTIVE
        assert run.HasField("create_time") and run.HasField("update_time")

    async def test_cancelling_a_run_that_ended_leaves_it_as_it_is(
        self, gateway: GatewaySide
    ) -> None:
        events = await self.generate(gateway)
        run = await gateway.stub.CancelRun(
            gateway_pb2.CancelRunRequest(run_id=events[0].run_id), metadata=gateway.metadata
        )
        assert (run.state, run.last_seq) == (events_pb2.RUN_STATE_BILLED, len(events))

    async def test_one_idempotency_key_is_one_run(self, gateway: GatewaySide) -> None:
        first = await self.start(gateway, idempotency_key="once")
        again = await self.start(gateway, idempotency_key="once")
        other = await self.start(gateway, idempotency_key="other")
        assert (again.run_id, again.seq) == (first.run_id, 1)
        assert other.run_id != first.run_id

    async def test_list_runs_pages_newest_first(self, gateway: GatewaySide) -> None:
        made = [(await self.start(gateway, prompt=f"run {i}")).run_id for i in range(3)]
        list_runs = gateway.stub.ListRuns
        first = await list_runs(gateway_pb2.ListRunsRequest(page_size=2), metadata=gateway.metadata)
        assert first.next_page_token
        rest = await list_runs(
            gateway_pb2.ListRunsRequest(page_size=2, page_token=first.next_page_token),
            metadata=gateway.metadata,
        )
        assert rest.next_page_token == ""
        assert [r.run_id for r in [*first.runs, *rest.runs]] == made[::-1]
        whole = await list_runs(gateway_pb2.ListRunsRequest(), metadata=gateway.metadata)
        assert [r.run_id for r in whole.runs] == made[::-1] and not whole.next_page_token

    async def test_list_models_lists_the_served_model_as_a_base(self, gateway: GatewaySide) -> None:
        listed = await gateway.stub.ListModels(
            gateway_pb2.ListModelsRequest(), metadata=gateway.metadata
        )
        [model] = listed.models
        assert (model.name, model.base) == ("tiny", "")
        assert model.context_length > 0

    @pytest.mark.parametrize(
        ("request_fields", "field"),
        [({"page_size": -1}, "page_size"), ({"page_token": "not-a-token"}, "page_token")],
    )
    async def test_bad_paging_is_an_invalid_argument(
        self, gateway: GatewaySide, request_fields: dict[str, object], field: str
    ) -> None:
        call = gateway.stub.ListRuns(
            gateway_pb2.ListRunsRequest(**request_fields), metadata=gateway.metadata
        )
        assert await refusal(call) == (grpc.StatusCode.INVALID_ARGUMENT, [field])

    @pytest.mark.parametrize(
        ("request_fields", "field"),
        [
            ({"sampling": events_pb2.SamplingParams(max_tokens=0)}, "sampling.max_tokens"),
            ({"prompt": ""}, "prompt"),
        ],
    )
    async def test_a_bad_request_is_an_invalid_argument_naming_the_field(
        self, gateway: GatewaySide, request_fields: dict[str, object], field: str
    ) -> None:
        request = generate_request()
        for name, value in request_fields.items():
            if isinstance(value, events_pb2.SamplingParams):
                request.sampling.CopyFrom(value)
            else:
                setattr(request, name, value)
        call = gateway.stub.Generate(request, metadata=gateway.metadata)
        assert await refusal(call.read()) == (grpc.StatusCode.INVALID_ARGUMENT, [field])
        listed = await gateway.stub.ListRuns(
            gateway_pb2.ListRunsRequest(), metadata=gateway.metadata
        )
        assert list(listed.runs) == []


async def nothing_to_do(run_id: str) -> None:
    """The fake's runs are scripted to the end from the start."""


class TestFakeGateway(GatewayContractTests):
    @pytest.fixture
    async def gateway(self) -> AsyncIterator[GatewaySide]:
        fake = await start_fake()
        async with grpc.aio.insecure_channel(fake.address) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            yield GatewaySide(stub, auth("tg_any_key"), nothing_to_do)
        await fake.server.stop(0)


class TestGatewayServicer(GatewayContractTests):
    @pytest.fixture
    async def gateway(
        self, database_url: str, kafka_bootstrap: str, kafka_topic: str, tiny_model_dir: Path
    ) -> AsyncIterator[GatewaySide]:
        async with running_admission(
            database_url, kafka_bootstrap, kafka_topic, tiny_model_dir
        ) as admission:
            _, key = await admission.new_tenant_key("contract")

            async def finish(run_id: str) -> None:
                await finish_run(admission.store, run_id, [5, 6, 7, 8], ["a", "b", "c", "d"])

            yield GatewaySide(admission.gateway, auth(key), finish)
