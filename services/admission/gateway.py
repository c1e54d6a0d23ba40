"""Admission's core: start a run (or find the one its idempotency key names),
follow its events, and cancel it when its client is gone for good."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import structlog
from prometheus_client import Counter as MetricCounter

from engine.sampling import blocks_for_run
from services.admission.admit import Admission, Admitted, admit
from services.admission.attachment_store import Attachments
from services.admission.backpressure import QueueBounds
from services.admission.cancel import Canceller
from services.admission.catalog import ModelCatalog
from services.admission.checks import Candidate, Checks
from services.admission.key_watch import KEY_CHECK_SECONDS, KeyWatch
from services.admission.requests import GenerateParams, Limits
from services.admission.run_store import find_by_idempotency_key
from services.admission.spend import worst_case_micros
from services.admission.stream import RunFeed, stream_events
from services.admission.stream_limits import (
    DEFAULT_MAX_CONCURRENT_STREAMS,
    StreamCounts,
    StreamLimits,
)
from services.admission.tenant_gate import DEFAULT_ADMISSIONS_PER_TENANT, TenantGate
from services.admission.tenant_store import TenantStore
from services.admission.tracing import generate_span
from services.core.auth import Principal, authenticate
from services.core.db import Database
from services.core.errors import ApiError, IdempotencyKeyReused, QuotaExceeded
from services.core.event_store import EventStore, IdempotencyKeyTaken
from services.core.fleet import FleetView
from services.core.key_cache import KEY_CACHE_SECONDS, KeyCache
from services.core.key_usage import KeyUsage
from services.core.live import Position
from services.core.pricing import PriceTable
from services.core.ratelimit import FailedAttempts
from services.core.runs import ENDED_STATES, RunState, StoredEvent, is_ended
from services.core.telemetry import current_traceparent, get_tracer

log = structlog.get_logger(__name__)

ADMITTED = MetricCounter("tollgate_admission_runs_admitted", "Runs admitted", ["model", "priority"])
UNTIL_BILLED = frozenset({RunState.BILLED})


@dataclass(frozen=True, slots=True)
class Started:
    """The run a request names, and its events this admission has just stored (none when
    the idempotency key named an earlier run)."""

    run_id: str
    stored: tuple[StoredEvent, ...] = ()
    # The x-ratelimit-* metadata of a run admitted now, to send before its events.
    rate_limits: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    limits: Limits
    block_size: int = 16
    queue: QueueBounds = field(default_factory=QueueBounds)
    # For tenants whose quota does not set `max_concurrent_streams`; 0 = unlimited.
    max_concurrent_streams: int = DEFAULT_MAX_CONCURRENT_STREAMS
    # What budgets reserve at (TOLLGATE_PRICES, as the ledger reads it).
    prices: PriceTable = field(default_factory=PriceTable)
    # How often the keys of open streams are read back (key_watch.py).
    key_check_interval: float = KEY_CHECK_SECONDS
    # How long a key's answer stands without a query (services.core.key_cache).
    key_cache_seconds: float = KEY_CACHE_SECONDS
    # One tenant's admissions in progress at once at this replica (tenant_gate.py).
    admissions_per_tenant: int = DEFAULT_ADMISSIONS_PER_TENANT


class Gateway:
    def __init__(
        self,
        db: Database,
        catalog: ModelCatalog,
        feed: RunFeed,
        canceller: Canceller,
        config: GatewayConfig,
        fleet: Callable[[], FleetView] | None = None,
        on_queued: Callable[[Admitted], None] | None = None,
        attachments: Attachments | None = None,
    ) -> None:
        """`fleet` gives the scheduler's latest answer (None: no scheduler, no load checks);
        `on_queued` is told of each new run once its `queued` event is committed; `run()`
        cancels the runs their clients abandoned."""
        self.db = db
        self.store = EventStore(db)
        self.catalog = catalog
        self.feed = feed
        self.canceller = canceller
        self.config = config
        self.on_queued = on_queued
        self.attachments = attachments or Attachments(db)
        self.key_watch = KeyWatch(db, feed, config.key_check_interval)
        self.streams = StreamCounts()
        self.stream_limits = StreamLimits(TenantStore(db), config.max_concurrent_streams)
        self.checks = Checks(
            db, catalog, config.limits, config.queue, self.streams, self.stream_limits, fleet
        )
        # Failed authentications per peer, on both fronts.
        self.auth_failures = FailedAttempts()
        # Each key's last use, written in batches by `run()`.
        self.key_usage = KeyUsage()
        # A few of each tenant's admissions at once (tenant_gate.py).
        self.tenant_gate = TenantGate(config.admissions_per_tenant)
        # Keys that authenticated lately, looked up again after `key_cache_seconds`.
        self.key_cache = KeyCache(config.key_cache_seconds)

    async def start(self, tenant_id: str, params: GenerateParams, key_id: str = "") -> Started:
        """Admits a new run, or finds the run this idempotency key already names; with the
        `queued` event when this call stored it (to `follow`). `key_id` names the API key
        whose own limits apply with the tenant's.

        Both fronts start here, so the run's trace starts here: the `queued` event carries
        this span's context to the scheduler, the worker and the ledger."""
        with generate_span(tenant_id, params) as span:
            started = await self._start(tenant_id, params, key_id)
            span.set_attribute("tollgate.run_id", started.run_id)
            return started

    async def _start(self, tenant_id: str, params: GenerateParams, key_id: str) -> Started:
        # Chosen first: the run is stored, and its idempotency key matched, as chosen.
        params = self.catalog.with_tool_format(params)
        checks, candidate = self.checks, Candidate(tenant_id, key_id, params)
        refused = await checks.first_refusal(checks.on_request, candidate)
        if refused is not None:
            raise refused
        # A key seen before is looked up only when the load refuses a run or admitting
        # conflicts on it: new keys, the common case, cost no extra query.
        refused = await checks.first_refusal(checks.on_load, candidate)
        if refused is not None:
            return await self._earlier_run(tenant_id, params, refused)
        run_id = f"run_{uuid.uuid4().hex}"
        # Held from here, so that requests racing past `open_streams` are refused before
        # their runs exist; the run's stream claims it (`follow`).
        try:
            self.streams.reserve(tenant_id, await self.stream_limits.get(tenant_id), run_id)
        except QuotaExceeded as refused:
            return await self._earlier_run(tenant_id, params, refused)
        try:
            async with self.tenant_gate.admitting(tenant_id):
                started = await self._admit(
                    replace(candidate, admission=await self._prepare(candidate, run_id))
                )
        except BaseException:
            self.streams.release(tenant_id, run_id)
            raise
        # Its stream follows now, however long admitting took.
        self.streams.renew(tenant_id, run_id)
        return started

    async def _admit(self, candidate: Candidate) -> Started:
        checks, admission, params = self.checks, candidate.admission, candidate.params
        assert admission is not None
        refused = await checks.first_refusal(checks.on_tokens, candidate)
        if refused is not None:
            raise refused
        with get_tracer().start_as_current_span("tollgate.admission.admit") as span:
            span.set_attribute("tollgate.run_id", admission.run_id)
            span.set_attribute("gen_ai.usage.input_tokens", len(admission.prompt_token_ids))
            try:
                admitted = await admit(
                    self.db,
                    admission,
                    lambda held: checks.first_refusal(
                        checks.on_hold, replace(candidate, held=held)
                    ),
                )
            except IdempotencyKeyTaken:
                self.streams.release(admission.tenant_id, admission.run_id)
                return await self._earlier_run(admission.tenant_id, params)
        if self.on_queued is not None:
            self.on_queued(admitted)
        ADMITTED.labels(params.model, params.priority).inc()
        log.info(
            "run admitted",
            run_id=admission.run_id,
            tenant_id=admission.tenant_id,
            prompt_tokens=len(admission.prompt_token_ids),
        )
        return Started(admission.run_id, (admitted.queued,), admitted.rate_limits)

    async def run(self) -> None:
        """Cancels the runs no client streams any more, once their grace is over, and
        writes the keys' last uses."""
        await asyncio.gather(
            self.attachments.run(self._cancel_abandoned),
            self.key_usage.run(self.db),
            self.key_watch.run(),
        )

    async def _prepare(self, candidate: Candidate, run_id: str) -> Admission:
        """The run to admit, its prompt tokenized by the model's tokenizer."""
        params = candidate.params
        model = self.catalog.get(params.model)
        prompt_token_ids = await asyncio.to_thread(model.prompt_token_ids, params)
        sampling = params.sampling
        return Admission(
            run_id=run_id,
            tenant_id=candidate.tenant_id,
            params=params,
            prompt_token_ids=prompt_token_ids,
            num_kv_blocks=blocks_for_run(
                len(prompt_token_ids), sampling.max_tokens, sampling.n, self.config.block_size
            ),
            traceparent=current_traceparent(),
            # A detached run gets no lease, and a run without one is never abandoned.
            replica_id="" if params.detached else self.attachments.replica_id,
            key_id=candidate.key_id,
            spend_micros=worst_case_micros(
                self.config.prices,
                params.model,
                len(prompt_token_ids),
                sampling.max_tokens * sampling.n,
            ),
        )

    async def principal(self, metadata: Sequence[tuple[str, str | bytes]], peer: str) -> Principal:
        """The tenant's API key that the request's `authorization` names; raises
        Unauthenticated. Both front doors ask here, so failures count per peer on both."""
        principal = await authenticate(
            self.db,
            metadata,
            peer=peer,
            failures=self.auth_failures,
            usage=self.key_usage,
            cache=self.key_cache,
        )
        assert principal.tenant_id is not None
        return principal

    async def aclose(self) -> None:
        await self.key_usage.flush_logged(self.db)
        await self.attachments.aclose()

    async def _earlier_run(
        self, tenant_id: str, params: GenerateParams, refused: ApiError | None = None
    ) -> Started:
        """The run this request's idempotency key already names, if it asked the same;
        with no such run, raises `refused` (None: a key conflict, so the run exists)."""
        existing = None
        if params.idempotency_key:
            existing = await find_by_idempotency_key(self.db, tenant_id, params.idempotency_key)
        if existing is None:
            assert refused is not None
            raise refused
        if existing.request_hash != params.request_hash():
            raise IdempotencyKeyReused(existing.run_id)
        return Started(existing.run_id)

    async def follow(
        self,
        principal: Principal,
        run_id: str,
        after: Position,
        until_terminal: bool,
        known: Sequence[StoredEvent] = (),
        *,
        live: bool = False,
    ) -> AsyncIterator[StoredEvent]:
        """The run's events after `after`, starting with `known` (the events right after
        it that the caller holds), and with `live` its tokens as they are made
        (`services.core.live`); while it lasts, the run counts as attached and as one of
        the tenant's streams, and the caller's key is watched: a stream whose key is
        revoked, expires or is rotated away ends with Unauthenticated.

        Raises QuotaExceeded (STREAMS_LIMITED) here, before any event, when the tenant
        holds as many streams as it may: a front can still answer with an error status."""
        assert principal.tenant_id is not None
        limit = await self.stream_limits.get(principal.tenant_id)
        self.streams.check(principal.tenant_id, limit, run_id)
        return self._follow(principal, limit, run_id, after, until_terminal, known, live)

    async def _follow(
        self,
        principal: Principal,
        limit: int,
        run_id: str,
        after: Position,
        until_terminal: bool,
        known: Sequence[StoredEvent],
        live: bool,
    ) -> AsyncIterator[StoredEvent]:
        assert principal.tenant_id is not None
        stop_kinds = ENDED_STATES if until_terminal else UNTIL_BILLED
        # Counted only once iterated: a stream its front never starts holds nothing but
        # its run's reservation, which lapses.
        with (
            self.streams.held(principal.tenant_id, limit, run_id),
            self.key_watch.watching(principal, run_id) as credential,
        ):
            # `known` holds the `queued` event this replica just stored with its lease.
            async with self.attachments.attached(run_id, leased=bool(known)):
                last_kind = None
                async for event in stream_events(
                    self.store,
                    self.feed,
                    run_id,
                    after,
                    stop_kinds,
                    known=known,
                    stopped=lambda: self.key_watch.has_lapsed(credential),
                    live=live,
                ):
                    yield event
                    last_kind = event.kind
                # Ended by its key, not by its run: a stream that ran to its end is whole.
                if last_kind not in stop_kinds and self.key_watch.has_lapsed(credential):
                    assert credential is not None
                    raise self.key_watch.ended(credential)

    async def _cancel_abandoned(self, run_id: str) -> None:
        run = await self.store.get_run(run_id)
        if run is not None and not is_ended(run.state):
            log.info("client gone, cancelling run", run_id=run_id)
            await self.canceller.cancel(run, "client disconnected")
