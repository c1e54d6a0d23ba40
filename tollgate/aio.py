"""Tollgate's clients: `Client` for a tenant's runs and usage, `AdminClient` for the operator.

`tollgate.aio` holds their asyncio forms, `AsyncClient` and `AsyncAdminClient`, and is the
one source of both: `make sdk` generates the synchronous `tollgate.client` from it.
Every failed call raises a `tollgate.errors.TollgateError` subclass.

    with Client("localhost:50051", api_key) as client:
        for event in client.generate("Hello", model="tiny", max_tokens=16):
            print(event.text, end="")

    async with AsyncClient("localhost:50051", api_key) as client:
        async for event in client.generate("Hello", model="tiny", max_tokens=16):
            print(event.text, end="")
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from datetime import datetime
from types import TracebackType
from typing import Any, Self, TypeVar

import grpc

from tollgate import convert
from tollgate.aio_stream import AsyncStream
from tollgate.errors import from_rpc_error
from tollgate.resume import NextCall, StreamTracker
from tollgate.structure import Structure
from tollgate.transport import (
    DEFAULT_RETRY,
    DEFAULT_TIMEOUT,
    Addresses,
    AsyncUnary,
    Messages,
    RootCertificates,
    bearer,
    channel_credentials,
)
from tollgate.transport import open_async_channel as open_channel
from tollgate.types import (
    ApiKey,
    ApiKeyPage,
    LedgerEntry,
    LedgerEntryPage,
    Model,
    Quota,
    Reconciliation,
    RetryPolicy,
    Run,
    RunPage,
    Tenant,
    UsageReport,
)
from tollgate.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    ledger_pb2,
    ledger_pb2_grpc,
)

T = TypeVar("T")


class _AsyncBase:
    """Channels, credentials and the unary-call wrapper shared by both clients."""

    def __init__(
        self,
        address: Addresses,
        secret: str,
        *,
        ledger_address: Addresses | None,
        timeout: float | None,
        credentials: grpc.ChannelCredentials | None,
        options: Sequence[tuple[str, Any]],
        root_certificates: RootCertificates | None = None,
    ) -> None:
        credentials = channel_credentials(credentials, root_certificates)
        # Several gateways: calls spread over them (`tollgate.transport.channel_target`).
        self._channel = open_channel(address, credentials, options)
        self._ledger_channel = (
            open_channel(ledger_address, credentials, options)
            if ledger_address and ledger_address != address
            else self._channel
        )
        self._metadata = bearer(secret)
        self._timeout = timeout
        self._ledger = ledger_pb2_grpc.LedgerServiceStub(self._ledger_channel)

    def __repr__(self) -> str:
        # Never the key or token.
        return f"{type(self).__name__}()"

    async def _unary(self, method: AsyncUnary[T], request: Any) -> T:
        try:
            return await method(request, timeout=self._timeout, metadata=self._metadata)
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None

    async def close(self) -> None:
        if self._ledger_channel is not self._channel:
            await self._ledger_channel.close()
        await self._channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # LedgerService: a tenant key sees its own tenant, the admin token every tenant.

    async def list_ledger_entries(
        self, *, tenant_id: str = "", run_id: str = "", page_size: int = 100, page_token: str = ""
    ) -> LedgerEntryPage:
        """One page of ledger entries."""
        request = ledger_pb2.ListLedgerEntriesRequest(
            tenant_id=tenant_id, run_id=run_id, page_size=page_size, page_token=page_token
        )
        response = await self._unary(self._ledger.ListLedgerEntries, request)
        entries = tuple(convert.ledger_entry_of(e) for e in response.entries)
        return LedgerEntryPage(entries=entries, next_page_token=response.next_page_token)

    async def iter_ledger_entries(
        self, *, tenant_id: str = "", run_id: str = "", page_size: int = 100
    ) -> AsyncIterator[LedgerEntry]:
        """Every ledger entry, page after page."""
        token = ""
        while True:
            page = await self.list_ledger_entries(
                tenant_id=tenant_id, run_id=run_id, page_size=page_size, page_token=token
            )
            for entry in page.entries:
                yield entry
            token = page.next_page_token
            if not token:
                return

    async def get_usage(
        self, *, tenant_id: str = "", start: datetime | None = None, end: datetime | None = None
    ) -> UsageReport:
        """Billed usage of a tenant (the caller's own for an API key) in [start, end)."""
        request = convert.usage_request(tenant_id, start, end)
        return convert.usage_report_of(await self._unary(self._ledger.GetUsage, request))

    async def get_reconciliation(self) -> Reconciliation:
        """Runs whose billing or KV reservation does not add up."""
        request = ledger_pb2.GetReconciliationRequest()
        return convert.reconciliation_of(await self._unary(self._ledger.GetReconciliation, request))


class AsyncClient(_AsyncBase):
    """A tenant's client: generate and follow runs, read its usage.

    `timeout` bounds each unary call; `stream_timeout`, when set, bounds each
    attempt of a stream, which is then resumed. `retry` governs resuming.
    `root_certificates` (PEM bytes, or a file's path) makes the channels TLS, trusting the
    servers those roots sign; `credentials` gives any other `grpc.ChannelCredentials`.
    """

    def __init__(
        self,
        address: Addresses,
        api_key: str,
        *,
        ledger_address: Addresses | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
        stream_timeout: float | None = None,
        retry: RetryPolicy = DEFAULT_RETRY,
        credentials: grpc.ChannelCredentials | None = None,
        options: Sequence[tuple[str, Any]] = (),
        root_certificates: RootCertificates | None = None,
    ) -> None:
        super().__init__(
            address,
            api_key,
            ledger_address=ledger_address,
            timeout=timeout,
            credentials=credentials,
            options=options,
            root_certificates=root_certificates,
        )
        self._gateway = gateway_pb2_grpc.GatewayServiceStub(self._channel)
        self._stream_timeout = stream_timeout
        self._retry = retry

    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: Messages | None = None,
        model: str,
        max_tokens: int = 256,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        frequency_penalty: float | None = None,
        presence_penalty: float | None = None,
        repetition_penalty: float | None = None,
        min_p: float | None = None,
        logit_bias: Mapping[int, float] | None = None,
        response_format: Mapping[str, Any] | None = None,
        json_schema: Mapping[str, Any] | bool | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        logprobs: bool = False,
        top_logprobs: int = 0,
        n: int | None = None,
        prompt_logprobs: bool = False,
        priority: str = "interactive",
        idempotency_key: str | None = None,
        disconnect_grace: float | None = None,
        until_terminal: bool = False,
    ) -> AsyncStream:
        """Starts a run (or attaches to the one `idempotency_key` names) and streams its events.

        The idempotency key defaults to a fresh UUID, so retries inside the stream
        never start a second run. The stream ends at `billed`, or at the terminal
        event with `until_terminal`. The call opens on the first iteration.
        Penalties and `logit_bias` (token id -> bias) are OpenAI's; `repetition_penalty`
        and `min_p` vLLM's.

        `response_format`, `tools`, `tool_choice` and `parallel_tool_calls` take OpenAI's
        shapes: `{"type": "json_object"}` or `{"type": "json_schema", "json_schema":
        {"name": ..., "schema": {...}}}`; `[{"type": "function", "function": {"name",
        "description", "parameters"}}]`; "auto", "none", "required" or `{"type": "function",
        "function": {"name": ...}}`. `json_schema` is a schema alone, short for the second
        response format. With tools the answer is text or calls (the stream's `tool_calls`).
        `logprobs` gives each streaming event's tokens their log-probabilities, with the
        `top_logprobs` (0 to 20) likeliest tokens in their place. `messages` may be
        `ChatMessage`s, (role, content) pairs or OpenAI's message dicts, `tool_calls` and
        `tool_call_id` included. `n` answers (1 to 16) share the prompt, each its own
        draw: events carry `index`, the stream's `texts` has each. `prompt_logprobs` puts
        the log-probability of each prompt token after the first (with `top_logprobs`
        alternatives) on the first streaming event. A malformed argument raises ValueError
        naming it.
        """
        request = convert.generate_request(
            prompt,
            messages=messages,
            model=model,
            max_tokens=max_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            stop=stop,
            stop_token_ids=stop_token_ids,
            ignore_eos=ignore_eos,
            penalties=convert.Penalties(
                frequency_penalty, presence_penalty, repetition_penalty, min_p, logit_bias
            ),
            structure=Structure(
                response_format, json_schema, tools, tool_choice, parallel_tool_calls
            ),
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            n=n,
            prompt_logprobs=prompt_logprobs,
            priority=priority,
            idempotency_key=idempotency_key,
            disconnect_grace=disconnect_grace,
            until_terminal=until_terminal,
        )
        tracker = StreamTracker(request=request, until_terminal=until_terminal)
        return AsyncStream(self._open_stream, tracker, self._retry, probe=self.get_run)

    async def generate_text(self, prompt: str | None = None, **kwargs: Any) -> str:
        """The whole text of a run; raises RunFailedError / RunCancelledError if it did not complete."""
        kwargs.setdefault("until_terminal", True)
        async with self.generate(prompt, **kwargs) as stream:
            await stream.wait()
            stream.raise_for_outcome()
            return stream.text

    def stream_run(
        self, run_id: str, starting_after: int | str = 0, *, until_terminal: bool = False
    ) -> AsyncStream:
        """A run's events after `starting_after` (0 = all): a seq, or the `position` of
        the last event a client has (a live event's says how far into its output), live
        until the run ends."""
        tracker = StreamTracker(
            run_id=run_id, starting_after=starting_after, until_terminal=until_terminal
        )
        return AsyncStream(self._open_stream, tracker, self._retry, probe=self.get_run)

    def _open_stream(self, call: NextCall) -> Any:
        options = {"timeout": self._stream_timeout, "metadata": self._metadata}
        if call.generate is not None:
            return self._gateway.Generate(call.generate, **options)
        return self._gateway.StreamRun(call.stream_run, **options)

    async def cancel_run(self, run_id: str) -> Run:
        """Asks the run to stop; returns its state as of the request."""
        request = gateway_pb2.CancelRunRequest(run_id=run_id)
        return convert.run_of(await self._unary(self._gateway.CancelRun, request))

    async def get_run(self, run_id: str) -> Run:
        request = gateway_pb2.GetRunRequest(run_id=run_id)
        return convert.run_of(await self._unary(self._gateway.GetRun, request))

    async def list_runs(self, page_size: int = 50, page_token: str = "") -> RunPage:
        """One page of the tenant's runs."""
        request = gateway_pb2.ListRunsRequest(page_size=page_size, page_token=page_token)
        response = await self._unary(self._gateway.ListRuns, request)
        runs = tuple(convert.run_of(r) for r in response.runs)
        return RunPage(runs=runs, next_page_token=response.next_page_token)

    async def list_models(self) -> list[Model]:
        """The models this key may use, adapters with their base model."""
        response = await self._unary(self._gateway.ListModels, gateway_pb2.ListModelsRequest())
        return [convert.model_of(m) for m in response.models]

    async def iter_runs(self, page_size: int = 100) -> AsyncIterator[Run]:
        """Every run of the tenant, page after page."""
        token = ""
        while True:
            page = await self.list_runs(page_size, token)
            for run in page.runs:
                yield run
            token = page.next_page_token
            if not token:
                return


class AsyncAdminClient(_AsyncBase):
    """The operator's client, authenticated with the admin token; TLS as `AsyncClient`."""

    def __init__(
        self,
        address: Addresses,
        admin_token: str,
        *,
        ledger_address: Addresses | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
        credentials: grpc.ChannelCredentials | None = None,
        options: Sequence[tuple[str, Any]] = (),
        root_certificates: RootCertificates | None = None,
    ) -> None:
        super().__init__(
            address,
            admin_token,
            ledger_address=ledger_address,
            timeout=timeout,
            credentials=credentials,
            options=options,
            root_certificates=root_certificates,
        )
        self._admin = admin_pb2_grpc.AdminServiceStub(self._channel)

    async def create_tenant(self, name: str, weight: int = 1) -> Tenant:
        request = admin_pb2.CreateTenantRequest(name=name, weight=weight)
        return convert.tenant_of(await self._unary(self._admin.CreateTenant, request))

    async def get_tenant(self, tenant_id: str) -> Tenant:
        request = admin_pb2.GetTenantRequest(tenant_id=tenant_id)
        return convert.tenant_of(await self._unary(self._admin.GetTenant, request))

    async def list_tenants(self) -> list[Tenant]:
        response = await self._unary(self._admin.ListTenants, admin_pb2.ListTenantsRequest())
        return [convert.tenant_of(t) for t in response.tenants]

    async def create_api_key(
        self,
        tenant_id: str,
        *,
        allowed_models: Sequence[str] = (),
        expire_time: datetime | None = None,
        alias: str = "",
    ) -> ApiKey:
        """A new key for the tenant; its `secret` is returned this once and stored hashed.
        `allowed_models` empty: every model; `expire_time` None: it never expires."""
        request = admin_pb2.CreateApiKeyRequest(
            tenant_id=tenant_id, allowed_models=allowed_models, alias=alias
        )
        if expire_time is not None:
            request.expire_time.CopyFrom(convert.to_timestamp(expire_time))
        return convert.api_key_of(await self._unary(self._admin.CreateApiKey, request))

    async def list_api_keys(
        self, tenant_id: str, page_size: int = 50, page_token: str = ""
    ) -> ApiKeyPage:
        """One page of the tenant's keys, oldest first (never their secrets)."""
        request = admin_pb2.ListApiKeysRequest(
            tenant_id=tenant_id, page_size=page_size, page_token=page_token
        )
        response = await self._unary(self._admin.ListApiKeys, request)
        keys = tuple(convert.api_key_of(k) for k in response.api_keys)
        return ApiKeyPage(api_keys=keys, next_page_token=response.next_page_token)

    async def rotate_api_key(self, key_id: str, overlap: float | None = None) -> ApiKey:
        """A new secret for the key (returned this once); the old one keeps working for
        `overlap` seconds (None: the server's default, 24 hours; at most 7 days)."""
        request = admin_pb2.RotateApiKeyRequest(key_id=key_id)
        if overlap is not None:
            request.overlap.CopyFrom(convert.to_duration(overlap))
        return convert.api_key_of(await self._unary(self._admin.RotateApiKey, request))

    async def revoke_api_key(self, key_id: str) -> ApiKey:
        request = admin_pb2.RevokeApiKeyRequest(key_id=key_id)
        return convert.api_key_of(await self._unary(self._admin.RevokeApiKey, request))

    async def set_quota(
        self,
        tenant_id: str,
        *,
        max_kv_blocks: int = 0,
        max_concurrent_runs: int = 0,
        max_concurrent_streams: int | None = None,
        requests_per_minute: int = 0,
        input_tokens_per_minute: int = 0,
        output_tokens_per_minute: int = 0,
        budget_micros: int = 0,
        budget_period: str = "month",
        key_id: str = "",
    ) -> Quota:
        """Replaces the tenant's limits (or, with `key_id`, that key's own, applied with
        the tenant's: the tighter wins); 0 means unlimited, `max_concurrent_streams` None
        the admission's default."""
        quota = admin_pb2.Quota(
            tenant_id=tenant_id,
            max_kv_blocks=max_kv_blocks,
            max_concurrent_runs=max_concurrent_runs,
            max_concurrent_streams=max_concurrent_streams,
            requests_per_minute=requests_per_minute,
            input_tokens_per_minute=input_tokens_per_minute,
            output_tokens_per_minute=output_tokens_per_minute,
            budget_micros=budget_micros,
            budget_period=budget_period,
            key_id=key_id,
        )
        response = await self._unary(self._admin.SetQuota, admin_pb2.SetQuotaRequest(quota=quota))
        return convert.quota_of(response)
