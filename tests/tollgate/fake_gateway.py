"""A scripted in-process GatewayService (plus Admin and Ledger) for SDK and CLI tests.

Each run is a fixed list of events. `breaks` scripts how successive stream calls
misbehave: abort with UNAVAILABLE after k events, end cleanly after k events,
resend events already delivered, or skip one.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_status import rpc_status

from services.core.errors import ApiError
from tollgate.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    events_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    ledger_pb2,
    ledger_pb2_grpc,
)

TENANT = "tenant-1"


@dataclass(frozen=True)
class Break:
    """How one stream call misbehaves."""

    after: int  # events sent before it happens
    how: str = "abort"  # "abort" (UNAVAILABLE) | "end" (OK, early) | "cancel" (CANCELLED)
    replay: int = 0  # resend this many already-delivered events first
    skip_seq: int | None = None  # leave out this seq


def script(
    run_id: str, pieces: Sequence[str], *, end: str = "completed"
) -> list[events_pb2.RunEvent]:
    """queued, prefill, one streaming event per piece, the terminal event, billed."""
    usage = events_pb2.Usage(prompt_tokens=3, output_tokens=len(pieces))
    events = [
        events_pb2.RunEvent(queued=events_pb2.Queued(model="tiny", prompt_token_ids=[1, 2, 3])),
        events_pb2.RunEvent(prefill=events_pb2.Prefill(worker_id="w1", lease_epoch=1)),
    ]
    for i, piece in enumerate(pieces):
        events.append(
            events_pb2.RunEvent(streaming=events_pb2.Streaming(token_ids=[10 + i], text=piece))
        )
    if end == "completed":
        events.append(
            events_pb2.RunEvent(completed=events_pb2.Completed(finish_reason="length", usage=usage))
        )
    else:
        events.append(
            events_pb2.RunEvent(
                failed=events_pb2.Failed(code="WORKER_LOST", message="worker gone", usage=usage)
            )
        )
    events.append(events_pb2.RunEvent(billed=events_pb2.Billed(amount_micros=1234, currency="USD")))
    states = {
        "queued": events_pb2.RUN_STATE_QUEUED,
        "prefill": events_pb2.RUN_STATE_PREFILL,
        "streaming": events_pb2.RUN_STATE_STREAMING,
        "completed": events_pb2.RUN_STATE_COMPLETED,
        "failed": events_pb2.RUN_STATE_FAILED,
        "billed": events_pb2.RUN_STATE_BILLED,
    }
    for seq, event in enumerate(events, start=1):
        event.run_id, event.seq, event.tenant_id = run_id, seq, TENANT
        event.state = states[event.WhichOneof("kind")]
        event.time.GetCurrentTime()
    return events


@dataclass
class FakeGateway(gateway_pb2_grpc.GatewayServiceServicer):
    pieces: Sequence[str] = ("Hel", "lo", ", ", "wor", "ld")
    end: str = "completed"
    breaks: deque[Break] = field(default_factory=deque)
    generate_error: ApiError | None = None
    runs: dict[str, list[events_pb2.RunEvent]] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)
    calls: list[tuple[str, Any, dict[str, str]]] = field(default_factory=list)
    delay: float = 0.0

    def _record(self, method: str, request: Any, context: Any) -> None:
        metadata = {k: v for k, v in context.invocation_metadata()}
        self.calls.append((method, request, metadata))

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[events_pb2.RunEvent]:
        self._record("Generate", request, context)
        if self.generate_error is not None:
            await _abort(context, self.generate_error)
        run_id = self.keys.get(request.idempotency_key)
        if run_id is None:
            run_id = str(uuid.uuid4())
            self.keys[request.idempotency_key] = run_id
            self.runs[run_id] = script(run_id, self.pieces, end=self.end)
        async for event in self._send(run_id, 0, request.until_terminal, context):
            yield event

    async def StreamRun(self, request: Any, context: Any) -> AsyncIterator[events_pb2.RunEvent]:
        self._record("StreamRun", request, context)
        if request.run_id not in self.runs:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"run {request.run_id} not found")
        async for event in self._send(
            request.run_id, request.starting_after, request.until_terminal, context
        ):
            yield event

    async def _send(
        self, run_id: str, after: int, until_terminal: bool, context: Any
    ) -> AsyncIterator[events_pb2.RunEvent]:
        plan = self.breaks.popleft() if self.breaks else None
        start = max(after - (plan.replay if plan else 0), 0)
        sent = 0
        for event in self.runs[run_id][start:]:
            if plan is not None and sent == plan.after:
                await _break(context, plan)
                return
            if plan is not None and event.seq == plan.skip_seq:
                continue
            if self.delay:
                await asyncio.sleep(self.delay)
            yield event
            sent += 1
            if until_terminal and event.state in (4, 5, 6):
                return

    async def GetRun(self, request: Any, context: Any) -> events_pb2.Run:
        self._record("GetRun", request, context)
        if request.run_id not in self.runs:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"run {request.run_id} not found")
        return self._run(request.run_id)

    async def CancelRun(self, request: Any, context: Any) -> events_pb2.Run:
        self._record("CancelRun", request, context)
        run = self._run(request.run_id)
        run.state = events_pb2.RUN_STATE_CANCELLED
        return run

    async def ListRuns(self, request: Any, context: Any) -> gateway_pb2.ListRunsResponse:
        self._record("ListRuns", request, context)
        ids = sorted(self.runs)
        start = int(request.page_token or 0)
        page = ids[start : start + request.page_size]
        token = str(start + request.page_size) if start + request.page_size < len(ids) else ""
        return gateway_pb2.ListRunsResponse(
            runs=[self._run(i) for i in page], next_page_token=token
        )

    def _run(self, run_id: str) -> events_pb2.Run:
        last = self.runs.get(run_id, [events_pb2.RunEvent()])[-1]
        return events_pb2.Run(
            run_id=run_id,
            tenant_id=TENANT,
            model="tiny",
            state=last.state,
            last_seq=last.seq,
            usage=events_pb2.Usage(prompt_tokens=3, output_tokens=len(self.pieces)),
            finish_reason="length",
            priority=events_pb2.PRIORITY_INTERACTIVE,
        )


async def _abort(context: Any, error: ApiError) -> None:
    await context.abort_with_status(rpc_status.to_status(error.to_status()))


async def _break(context: Any, plan: Break) -> None:
    if plan.how == "abort":
        await context.abort(grpc.StatusCode.UNAVAILABLE, "connection dropped")
    if plan.how == "cancel":
        await context.abort(grpc.StatusCode.CANCELLED, "cancelled by a proxy")
    # "end": the server closes the stream with OK although the run goes on.


@dataclass
class FakeAdmin(admin_pb2_grpc.AdminServiceServicer):
    tenants: dict[str, admin_pb2.Tenant] = field(default_factory=dict)
    calls: list[tuple[str, Any, dict[str, str]]] = field(default_factory=list)

    async def CreateTenant(self, request: Any, context: Any) -> admin_pb2.Tenant:
        self.calls.append(("CreateTenant", request, dict(context.invocation_metadata())))
        tenant_id = f"t-{len(self.tenants) + 1}"
        tenant = admin_pb2.Tenant(
            tenant_id=tenant_id, name=request.name, weight=request.weight,
            quota=admin_pb2.Quota(tenant_id=tenant_id),
        )  # fmt: skip
        self.tenants[tenant_id] = tenant
        return tenant

    async def GetTenant(self, request: Any, context: Any) -> admin_pb2.Tenant:
        if request.tenant_id not in self.tenants:
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such tenant")
        return self.tenants[request.tenant_id]

    async def ListTenants(self, request: Any, context: Any) -> admin_pb2.ListTenantsResponse:
        return admin_pb2.ListTenantsResponse(tenants=list(self.tenants.values()))

    async def CreateApiKey(self, request: Any, context: Any) -> admin_pb2.ApiKey:
        return admin_pb2.ApiKey(key_id="k-1", tenant_id=request.tenant_id, secret="tg_secret_1")

    async def RevokeApiKey(self, request: Any, context: Any) -> admin_pb2.ApiKey:
        return admin_pb2.ApiKey(key_id=request.key_id, tenant_id="t-1", revoked=True)

    async def SetQuota(self, request: Any, context: Any) -> admin_pb2.Quota:
        self.calls.append(("SetQuota", request, dict(context.invocation_metadata())))
        self.tenants[request.quota.tenant_id].quota.CopyFrom(request.quota)
        return request.quota


@dataclass
class FakeLedger(ledger_pb2_grpc.LedgerServiceServicer):
    calls: list[tuple[str, Any, dict[str, str]]] = field(default_factory=list)
    reconciliation_ok: bool = True

    async def GetUsage(self, request: Any, context: Any) -> ledger_pb2.GetUsageResponse:
        self.calls.append(("GetUsage", request, dict(context.invocation_metadata())))
        lines = [
            ledger_pb2.UsageLine(billing_type="input_tokens", quantity=30, amount_micros=300),
            ledger_pb2.UsageLine(
                billing_type="output_tokens", quantity=50, amount_micros=1_500_000
            ),
        ]
        return ledger_pb2.GetUsageResponse(
            tenant_id=request.tenant_id or TENANT, num_runs=2, lines=lines,
            amount_micros=1_500_300, currency="USD",
        )  # fmt: skip

    async def ListLedgerEntries(
        self, request: Any, context: Any
    ) -> ledger_pb2.ListLedgerEntriesResponse:
        self.calls.append(("ListLedgerEntries", request, dict(context.invocation_metadata())))
        entry = events_pb2.LedgerEntry(
            entry_id="e1", tenant_id=TENANT, run_id="r1", billing_type="output_tokens",
            quantity=5, unit_price_micros=2, amount_micros=10,
        )  # fmt: skip
        return ledger_pb2.ListLedgerEntriesResponse(entries=[entry])

    async def GetReconciliation(self, request: Any, context: Any) -> ledger_pb2.Reconciliation:
        if self.reconciliation_ok:
            return ledger_pb2.Reconciliation(ok=True)
        return ledger_pb2.Reconciliation(ok=False, unbilled_run_ids=["r9"])


@dataclass
class FakeServer:
    address: str
    gateway: FakeGateway
    admin: FakeAdmin
    ledger: FakeLedger
    server: grpc.aio.Server


async def start_fake(port: int = 0, gateway: FakeGateway | None = None) -> FakeServer:
    """A server with all three fakes on 127.0.0.1 (a free port unless `port` is given)."""
    server = grpc.aio.server()
    fake = FakeServer(
        address="",
        gateway=gateway or FakeGateway(),
        admin=FakeAdmin(),
        ledger=FakeLedger(),
        server=server,
    )
    gateway_pb2_grpc.add_GatewayServiceServicer_to_server(fake.gateway, server)
    admin_pb2_grpc.add_AdminServiceServicer_to_server(fake.admin, server)
    ledger_pb2_grpc.add_LedgerServiceServicer_to_server(fake.ledger, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    fake.address = f"127.0.0.1:{bound}"
    return fake
