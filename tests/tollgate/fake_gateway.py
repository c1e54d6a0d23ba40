"""A scripted in-process GatewayService (plus Admin and Ledger) for SDK and CLI tests.

Each run is a fixed list of events. `breaks` scripts how successive stream calls
misbehave: abort with UNAVAILABLE after k events, end cleanly after k events,
resend events already delivered, or skip one. With `live`, a stream that asks for
live events gets each piece but the first live before its stored event, as admission
sends them.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from services.admission.tenant_store import DEFAULT_MAX_CONCURRENT_RUNS
from services.core.errors import (
    ApiError,
    FailedPrecondition,
    FieldViolation,
    InvalidArgument,
    NotFound,
)
from services.core.grpc_errors import rpc_errors
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


STATES = {
    "queued": events_pb2.RUN_STATE_QUEUED,
    "prefill": events_pb2.RUN_STATE_PREFILL,
    "streaming": events_pb2.RUN_STATE_STREAMING,
    "completed": events_pb2.RUN_STATE_COMPLETED,
    "failed": events_pb2.RUN_STATE_FAILED,
    "cancelled": events_pb2.RUN_STATE_CANCELLED,
    "billed": events_pb2.RUN_STATE_BILLED,
}
TERMINAL = (
    events_pb2.RUN_STATE_COMPLETED,
    events_pb2.RUN_STATE_FAILED,
    events_pb2.RUN_STATE_CANCELLED,
)
ENDED = (*TERMINAL, events_pb2.RUN_STATE_BILLED)
PROMPT_TOKEN_IDS = (1, 2, 3)


def script(
    run_id: str,
    pieces: Sequence[str],
    *,
    end: str = "completed",
    request: events_pb2.GenerateRequest | None = None,
    at: bool = False,
) -> list[events_pb2.RunEvent]:
    """queued, prefill, one streaming event per piece, the terminal event, billed.
    With `at`, each streaming event says where its piece starts (one token a piece).

    `end="running"` stops after the streaming events: a run still going, to plant in
    `FakeGateway.runs` (Generate would leave its stream open forever).
    """
    request = request or events_pb2.GenerateRequest(model="tiny")
    queued = events_pb2.Queued(
        model=request.model,
        priority=request.priority or events_pb2.PRIORITY_INTERACTIVE,
        prompt_token_ids=PROMPT_TOKEN_IDS,
        idempotency_key=request.idempotency_key,
    )
    queued.sampling.CopyFrom(request.sampling)
    usage = events_pb2.Usage(prompt_tokens=len(PROMPT_TOKEN_IDS), output_tokens=len(pieces))
    events = [
        events_pb2.RunEvent(queued=queued),
        events_pb2.RunEvent(prefill=events_pb2.Prefill(worker_id="w1", lease_epoch=1)),
    ]
    for i, piece in enumerate(pieces):
        streaming = events_pb2.Streaming(token_ids=[10 + i], text=piece)
        if at:
            streaming.at[:] = [i, sum(len(p) for p in pieces[:i])]
        if request.sampling.logprobs:
            streaming.logprobs.append(logprob_of(10 + i, request.sampling.top_logprobs))
        events.append(events_pb2.RunEvent(streaming=streaming))
    if end == "completed":
        events.append(
            events_pb2.RunEvent(completed=events_pb2.Completed(finish_reason="length", usage=usage))
        )
    elif end == "failed":
        events.append(
            events_pb2.RunEvent(
                failed=events_pb2.Failed(code="WORKER_LOST", message="worker gone", usage=usage)
            )
        )
    if end != "running":
        events.append(
            events_pb2.RunEvent(billed=events_pb2.Billed(amount_micros=1234, currency="USD"))
        )
    for seq, event in enumerate(events, start=1):
        _stamp(event, run_id, seq)
    return events


def logprob_of(token_id: int, num_top: int) -> events_pb2.TokenLogprob:
    """The token at -0.5, and the `num_top` likeliest: itself, then the next ids, each less likely."""
    top = [
        events_pb2.TopLogprob(token_id=token_id + k, logprob=-0.5 * (k + 1)) for k in range(num_top)
    ]
    return events_pb2.TokenLogprob(token_id=token_id, logprob=-0.5, top=top)


def _stamp(event: events_pb2.RunEvent, run_id: str, seq: int) -> None:
    event.run_id, event.seq, event.tenant_id = run_id, seq, TENANT
    event.state = STATES[event.WhichOneof("kind")]
    event.time.GetCurrentTime()


def run_of(events: Sequence[events_pb2.RunEvent]) -> events_pb2.Run:
    """The `Run` a run's events add up to, as the gateway's projection has it."""
    first, last = events[0], events[-1]
    run = events_pb2.Run(
        run_id=first.run_id,
        tenant_id=first.tenant_id,
        model=first.queued.model,
        state=last.state,
        last_seq=last.seq,
        idempotency_key=first.queued.idempotency_key,
        priority=first.queued.priority,
    )
    run.create_time.CopyFrom(first.time)
    run.update_time.CopyFrom(last.time)
    for event in events:
        body = getattr(event, event.WhichOneof("kind"))
        if event.state in TERMINAL:
            run.usage.CopyFrom(body.usage)
            run.finish_reason = body.finish_reason if event.HasField("completed") else ""
            run.finish_reason = run.finish_reason or event.WhichOneof("kind")
    return run


def _invalid(field: str, description: str) -> InvalidArgument:
    return InvalidArgument([FieldViolation(field, description)])


def _generate_violations(request: events_pb2.GenerateRequest) -> list[FieldViolation]:
    found = []
    if request.sampling.max_tokens <= 0:
        found.append(FieldViolation("sampling.max_tokens", "must be greater than 0"))
    if not request.prompt and not request.messages:
        found.append(FieldViolation("prompt", "set a prompt or messages"))
    return found


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
    models: Sequence[gateway_pb2.Model] = (gateway_pb2.Model(name="tiny", context_length=2048),)
    live: bool = False

    def _record(self, method: str, request: Any, context: Any) -> None:
        metadata = {k: v for k, v in context.invocation_metadata()}
        self.calls.append((method, request, metadata))

    def _known(self, run_id: str) -> list[events_pb2.RunEvent]:
        if run_id not in self.runs:
            raise NotFound(f"run {run_id!r} not found")
        return self.runs[run_id]

    @rpc_errors
    async def Generate(self, request: Any, context: Any) -> AsyncIterator[events_pb2.RunEvent]:
        self._record("Generate", request, context)
        if self.generate_error is not None:
            raise self.generate_error
        if violations := _generate_violations(request):
            raise InvalidArgument(violations)
        run_id = self.keys.get(request.idempotency_key) if request.idempotency_key else None
        if run_id is None:
            run_id = str(uuid.uuid4())
            self.keys[request.idempotency_key] = run_id
            self.runs[run_id] = script(
                run_id, self.pieces, end=self.end, request=request, at=self.live
            )
        start = (0, 0, 0)
        async for event in self._send(run_id, start, request.until_terminal, request.live, context):
            yield event

    @rpc_errors
    async def StreamRun(self, request: Any, context: Any) -> AsyncIterator[events_pb2.RunEvent]:
        self._record("StreamRun", request, context)
        self._known(request.run_id)
        start = (request.starting_after, request.after_tokens, request.after_chars)
        async for event in self._send(
            request.run_id, start, request.until_terminal, request.live, context
        ):
            yield event

    async def _send(
        self,
        run_id: str,
        after: tuple[int, int, int],
        until_terminal: bool,
        live: bool,
        context: Any,
    ) -> AsyncIterator[events_pb2.RunEvent]:
        plan = self.breaks.popleft() if self.breaks else None
        start = max(after[0] - (plan.replay if plan else 0), 0)
        sent = 0
        stored = self.runs[run_id][start:]
        for event in as_sent(stored, (after[1], after[2]), live and self.live):
            if plan is not None and sent == plan.after:
                await _break(context, plan)
                return
            if plan is not None and event.seq == plan.skip_seq:
                continue
            if self.delay:
                await asyncio.sleep(self.delay)
            yield event
            sent += 1
            if until_terminal and event.state in TERMINAL:
                return

    @rpc_errors
    async def GetRun(self, request: Any, context: Any) -> events_pb2.Run:
        self._record("GetRun", request, context)
        return run_of(self._known(request.run_id))

    @rpc_errors
    async def CancelRun(self, request: Any, context: Any) -> events_pb2.Run:
        """Ends a run still going as `cancelled`; a run that ended stays as it is."""
        self._record("CancelRun", request, context)
        events = self._known(request.run_id)
        if events[-1].state not in ENDED:
            streamed = sum(len(e.streaming.token_ids) for e in events)
            usage = events_pb2.Usage(prompt_tokens=len(PROMPT_TOKEN_IDS), output_tokens=streamed)
            cancelled = events_pb2.RunEvent(
                cancelled=events_pb2.Cancelled(reason="cancelled by client", usage=usage)
            )
            _stamp(cancelled, request.run_id, len(events) + 1)
            events.append(cancelled)
        return run_of(events)

    @rpc_errors
    async def ListRuns(self, request: Any, context: Any) -> gateway_pb2.ListRunsResponse:
        """Newest first, `page_size` at a time (0: 50); the token is an offset."""
        self._record("ListRuns", request, context)
        if request.page_size < 0:
            raise _invalid("page_size", "must not be negative")
        if request.page_token and not request.page_token.isdigit():
            raise _invalid("page_token", "not a token this service issued")
        ids = list(reversed(self.runs))
        start, size = int(request.page_token or 0), request.page_size or 50
        page = ids[start : start + size]
        token = str(start + size) if start + size < len(ids) else ""
        return gateway_pb2.ListRunsResponse(
            runs=[run_of(self.runs[i]) for i in page], next_page_token=token
        )

    @rpc_errors
    async def ListModels(self, request: Any, context: Any) -> gateway_pb2.ListModelsResponse:
        self._record("ListModels", request, context)
        return gateway_pb2.ListModelsResponse(models=self.models)


def as_sent(
    events: Iterable[events_pb2.RunEvent], output: tuple[int, int], live: bool
) -> Iterator[events_pb2.RunEvent]:
    """`events` as admission sends them to a stream that has the run's output up to
    `output`: with `live`, each piece but the first comes live first, under the seq
    before it; a stored piece the stream already has comes cut to nothing."""
    for event in events:
        at = tuple(event.streaming.at)
        if len(at) != 2:
            yield event
            continue
        end = (at[0] + len(event.streaming.token_ids), at[1] + len(event.streaming.text))
        if live and at[0] > 0 and at == output:
            yield _live_copy(event)
            output = end
        yield _cut_to_nothing(event, end) if end <= output else event
        output = max(output, end)


def _live_copy(event: events_pb2.RunEvent) -> events_pb2.RunEvent:
    copy = events_pb2.RunEvent()
    copy.CopyFrom(event)
    copy.seq, copy.live = event.seq - 1, True
    return copy


def _cut_to_nothing(event: events_pb2.RunEvent, end: tuple[int, int]) -> events_pb2.RunEvent:
    cut = events_pb2.RunEvent()
    cut.CopyFrom(event)
    for name in ("token_ids", "text", "logprobs"):
        cut.streaming.ClearField(name)
    cut.streaming.at[:] = end
    return cut


async def _break(context: Any, plan: Break) -> None:
    if plan.how == "abort":
        await context.abort(grpc.StatusCode.UNAVAILABLE, "connection dropped")
    if plan.how == "cancel":
        await context.abort(grpc.StatusCode.CANCELLED, "cancelled by a proxy")
    # "end": the server closes the stream with OK although the run goes on.


@dataclass
class FakeAdmin(admin_pb2_grpc.AdminServiceServicer):
    tenants: dict[str, admin_pb2.Tenant] = field(default_factory=dict)
    keys: dict[str, admin_pb2.ApiKey] = field(default_factory=dict)
    calls: list[tuple[str, Any, dict[str, str]]] = field(default_factory=list)

    def _tenant(self, tenant_id: str) -> admin_pb2.Tenant:
        if tenant_id not in self.tenants:
            raise NotFound(f"tenant {tenant_id} does not exist")
        return self.tenants[tenant_id]

    @rpc_errors
    async def CreateTenant(self, request: Any, context: Any) -> admin_pb2.Tenant:
        self.calls.append(("CreateTenant", request, dict(context.invocation_metadata())))
        name = request.name.strip()
        if not name:
            raise _invalid("name", "must not be empty")
        if request.weight < 0:
            raise _invalid("weight", "must be positive (0 means the default, 1)")
        if any(t.name == name for t in self.tenants.values()):
            raise FailedPrecondition(f"a tenant named {name!r} exists", "TENANT_EXISTS")
        tenant_id = f"t-{len(self.tenants) + 1}"
        tenant = admin_pb2.Tenant(
            tenant_id=tenant_id, name=name, weight=request.weight or 1,
            quota=admin_pb2.Quota(
                tenant_id=tenant_id, max_concurrent_runs=DEFAULT_MAX_CONCURRENT_RUNS
            ),
        )  # fmt: skip
        self.tenants[tenant_id] = tenant
        return tenant

    @rpc_errors
    async def GetTenant(self, request: Any, context: Any) -> admin_pb2.Tenant:
        return self._tenant(request.tenant_id)

    @rpc_errors
    async def ListTenants(self, request: Any, context: Any) -> admin_pb2.ListTenantsResponse:
        return admin_pb2.ListTenantsResponse(tenants=list(self.tenants.values()))

    @rpc_errors
    async def CreateApiKey(self, request: Any, context: Any) -> admin_pb2.ApiKey:
        """The secret is in this answer only."""
        self.calls.append(("CreateApiKey", request, dict(context.invocation_metadata())))
        self._tenant(request.tenant_id)
        n = len(self.keys) + 1
        key = admin_pb2.ApiKey(
            key_id=f"k-{n}", tenant_id=request.tenant_id, alias=request.alias,
            allowed_models=request.allowed_models, expire_time=request.expire_time,
        )  # fmt: skip
        self.keys[key.key_id] = key
        answer = admin_pb2.ApiKey(secret=f"tg_secret_{n}")
        answer.MergeFrom(key)
        return answer

    @rpc_errors
    async def ListApiKeys(self, request: Any, context: Any) -> admin_pb2.ListApiKeysResponse:
        """Pages of one key, to be followed to the end."""
        keys = [k for k in self.keys.values() if k.tenant_id == request.tenant_id]
        start = int(request.page_token or 0)
        more = str(start + 1) if start + 1 < len(keys) else ""
        return admin_pb2.ListApiKeysResponse(api_keys=keys[start : start + 1], next_page_token=more)

    @rpc_errors
    async def RotateApiKey(self, request: Any, context: Any) -> admin_pb2.ApiKey:
        self.calls.append(("RotateApiKey", request, dict(context.invocation_metadata())))
        if request.key_id not in self.keys:
            raise NotFound(f"API key {request.key_id} does not exist")
        answer = admin_pb2.ApiKey(secret=f"tg_rotated_{request.key_id}")
        answer.MergeFrom(self.keys[request.key_id])
        answer.previous_secret_expire_time.GetCurrentTime()
        return answer

    @rpc_errors
    async def RevokeApiKey(self, request: Any, context: Any) -> admin_pb2.ApiKey:
        if request.key_id not in self.keys:
            raise NotFound(f"API key {request.key_id} does not exist")
        self.keys[request.key_id].revoked = True
        return self.keys[request.key_id]

    @rpc_errors
    async def SetQuota(self, request: Any, context: Any) -> admin_pb2.Quota:
        self.calls.append(("SetQuota", request, dict(context.invocation_metadata())))
        quota = request.quota
        for name in ("max_kv_blocks", "max_concurrent_runs", "max_concurrent_streams"):
            if getattr(quota, name) < 0:
                raise _invalid(f"quota.{name}", "must not be negative")
        self._tenant(quota.tenant_id).quota.CopyFrom(quota)
        return quota


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
            entry_id="e1", tenant_id=request.tenant_id or TENANT, run_id=request.run_id or "r1",
            idempotency_key="r1:output_tokens", billing_type="output_tokens",
            quantity=5, unit_price_micros=2, amount_micros=10,
        )  # fmt: skip
        entry.create_time.GetCurrentTime()
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
