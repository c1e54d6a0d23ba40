"""Every reason admission refuses a new run, in the order `Gateway.start` asks them.

Each check has one shape: it reads the `Candidate`, the run on its way in as far as it is
known at the check's stage, and returns the refusal (an `ApiError` naming the field or
the limit at fault) or None. The stages run in this order, cheapest first:

1. `on_request`: the request alone, and the model it names, no I/O.
2. `on_load`: the moment's state: the tenant's open streams, the scheduler's queues and
   the fleet's free KV, the tenant's share of the queue. A retry of a run already admitted
   under the same idempotency key is not refused here: it finds that run. Once these pass,
   `Gateway.start` reserves the run's stream, refusing as `open_streams` does, so that
   requests racing past that check are refused before their runs exist.
3. `on_tokens`: the prompt once tokenized: the model's context and vocabulary, the
   largest worker serving the model, the parameters its engines honour, the response
   format and tools (compiled for the model's tokenizer), the size of the `queued` event.
4. `on_hold`: the tenant's and the key's quotas, read under the tenant's row lock in the
   transaction that stores the run and reserves what it may use (`admit.py`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncConnection

from engine.dialects import unsupported
from engine.errors import RequestError
from engine.grammar import Grammars
from services.admission.admit import Admission, Held
from services.admission.backpressure import (
    QueueBounds,
    class_refusal,
    may_hold_a_share,
    queue_refusal,
    share_refusal,
)
from services.admission.catalog import ModelCatalog
from services.admission.requests import GenerateParams, Limits, field_violations
from services.admission.run_store import num_queued
from services.admission.stream_limits import StreamCounts, StreamLimits, streams_limited
from services.core.codec import encoded_size
from services.core.db import Database
from services.core.errors import (
    ApiError,
    FailedPrecondition,
    FieldViolation,
    InvalidArgument,
    QuotaExceeded,
)
from services.core.fleet import FleetView
from services.core.quota_store import Subject, window_entries
from services.core.quotas import (
    MODEL_NOT_PRICED,
    Refusal,
    SubjectUsage,
    cost_of,
    oversized,
    refusal,
    window_wait,
)
from services.core.runs import RunState
from services.core.validation import shown


@dataclass(frozen=True, slots=True)
class Candidate:
    """A run on its way in, as the checks of each stage see it."""

    tenant_id: str
    key_id: str
    params: GenerateParams
    # From `on_tokens` on: the run as it would be stored, its prompt tokenized.
    admission: Admission | None = None
    # In `on_hold`: the quotas it is held to.
    held: Held | None = None


Check = Callable[[Candidate], Awaitable[ApiError | None]]


class Checks:
    def __init__(
        self,
        db: Database,
        catalog: ModelCatalog,
        limits: Limits,
        queue: QueueBounds,
        streams: StreamCounts,
        stream_limits: StreamLimits,
        fleet: Callable[[], FleetView] | None = None,
    ) -> None:
        """`fleet` gives the scheduler's latest answer; None (no scheduler) checks no load."""
        self.db = db
        self.catalog = catalog
        self.limits = limits
        self.queue = queue
        self.streams = streams
        self.stream_limits = stream_limits
        self.fleet = fleet
        # A base model's compiled schemas and grammars (its adapters share them).
        self._grammars: dict[str, Grammars] = {}
        self._compiling = asyncio.Lock()  # Grammars is not thread-safe
        self.on_request: tuple[Check, ...] = (self.fields, self.tool_format)
        self.on_load: tuple[Check, ...] = (self.open_streams, self.queue_bounds, self.queue_share)
        self.on_tokens: tuple[Check, ...] = (
            self.context_length,
            self.vocabulary,
            self.largest_worker,
            self.engine_params,
            self.structure,
            self.event_size,
        )
        self.on_hold: tuple[Check, ...] = (self.run_size, self.quotas)

    @staticmethod
    async def first_refusal(stage: Sequence[Check], run: Candidate) -> ApiError | None:
        for check in stage:
            refused = await check(run)
            if refused is not None:
                return refused
        return None

    # on_request

    async def fields(self, run: Candidate) -> ApiError | None:
        """Every bad field of the request, at once."""
        found = field_violations(run.params, self.catalog.names(), self.limits)
        return InvalidArgument(found) if found else None

    async def tool_format(self, run: Candidate) -> ApiError | None:
        """Calls in a format other than the generic one or the model's own: its chat
        template could not show them to the model."""
        chosen = run.params.sampling.structure.tool_format
        own = self.catalog.get(run.params.model).tool_format
        if chosen in ("", "generic", own):
            return None
        message = (
            f"{shown(run.params.model)} writes tool calls as {own!r}; ask for that or 'generic'"
        )
        return InvalidArgument([FieldViolation("sampling.tool_format", message)])

    # on_load

    async def open_streams(self, run: Candidate) -> ApiError | None:
        """A run whose stream would be refused is refused before it exists."""
        limit = await self.stream_limits.get(run.tenant_id)
        return (
            streams_limited(run.tenant_id, limit)
            if self.streams.is_full(run.tenant_id, limit)
            else None
        )

    async def queue_bounds(self, run: Candidate) -> ApiError | None:
        """The whole queue, the run's class's queue and the fleet's free KV (backpressure.py)."""
        if self.fleet is None:
            return None
        view = self.fleet()
        return queue_refusal(self.queue, view.num_queued_runs) or class_refusal(
            self.queue, view, run.params.priority, run.tenant_id
        )

    async def queue_share(self, run: Candidate) -> ApiError | None:
        """The tenant's runs queued, against its share of the queue; counted only once the
        queue is long enough for any tenant to hold its whole share."""
        if self.fleet is None or not may_hold_a_share(self.queue, self.fleet().num_queued_runs):
            return None
        queued = await num_queued(self.db, run.tenant_id, self.queue.runs_per_tenant())
        return share_refusal(self.queue, run.tenant_id, queued)

    # on_tokens

    async def context_length(self, run: Candidate) -> ApiError | None:
        num_prompt, max_tokens = _sizes(run)
        context = self.catalog.get(run.params.model).context_length
        if num_prompt + max_tokens <= context:
            return None
        if num_prompt >= context:
            message = f"{num_prompt} prompt tokens exceed the context length of {context}"
            return InvalidArgument([FieldViolation("prompt", message)])
        message = (
            f"prompt ({num_prompt} tokens) + max_tokens exceeds the context length of {context}"
        )
        return InvalidArgument([FieldViolation("sampling.max_tokens", message)])

    async def vocabulary(self, run: Candidate) -> ApiError | None:
        """Stop token ids, or biased ones, the model can never produce are a client's mistake."""
        vocab_size = self.catalog.get(run.params.model).vocab_size
        sampling = run.params.sampling
        message = f"token ids must be below the model's vocabulary size, {vocab_size}"
        if any(t >= vocab_size for t in sampling.stop_token_ids):
            return InvalidArgument([FieldViolation("sampling.stop_token_ids", message)])
        if any(t >= vocab_size for t, _ in sampling.logit_bias):
            return InvalidArgument([FieldViolation("sampling.logit_bias", message)])
        return None

    async def largest_worker(self, run: Candidate) -> ApiError | None:
        """A run larger than every live worker's pool serving its model could never run."""
        model = run.params.model
        largest = self.fleet().max_run_tokens.get(model) if self.fleet is not None else None
        num_prompt, max_tokens = _sizes(run)
        if largest is None or num_prompt + max_tokens <= largest:
            return None
        message = (
            f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) exceeds the "
            f"{largest} tokens the largest worker serving {model} can hold"
        )
        return InvalidArgument([FieldViolation("sampling.max_tokens", message)])

    async def engine_params(self, run: Candidate) -> ApiError | None:
        """A sampling parameter that no engine serving the model can honour (an OpenAI
        server has no top_k) is refused rather than ignored."""
        if self.fleet is None:
            return None
        entry = self.catalog.get(run.params.model)
        kinds = self.fleet().engine_kinds(entry.parent or entry.name)
        sampling = run.params.sampling.payload()
        found = [unsupported(kind, sampling) for kind in kinds]
        if not kinds or not all(found):
            return None
        name, why = found[0]  # type: ignore[misc]
        return InvalidArgument([FieldViolation(f"sampling.{name}", f"{why}; leave it unset")])

    async def structure(self, run: Candidate) -> ApiError | None:
        """A response format or tools the engine's grammar compiler refuses for the model,
        refused before the run exists rather than failing on a worker."""
        structure = run.params.sampling.structure
        if not structure.constrained:
            return None
        entry = self.catalog.get(run.params.model)
        base = entry.parent or entry.name
        if base not in self._grammars:
            self._grammars[base] = Grammars(entry.tokenizer, entry.vocab_size)
        json_schema, grammar = structure.constraint()
        try:
            # Compiling a large schema takes a while; the event loop must not wait on it.
            async with self._compiling:
                await asyncio.to_thread(self._grammars[base].check, json_schema, grammar)
        except RequestError as error:
            field = "tools" if structure.calls_tools else "response_format.json_schema"
            return InvalidArgument([FieldViolation(f"sampling.{field}", str(error))])
        return None

    async def event_size(self, run: Candidate) -> ApiError | None:
        """The `queued` event as published must stay well under the broker's message limit:
        one over it would stall the relay, and every event behind it, for everybody."""
        assert run.admission is not None
        num_bytes = encoded_size(RunState.QUEUED, run.admission.queued_payload())
        if num_bytes <= self.limits.max_event_bytes:
            return None
        field = "messages" if run.params.messages else "prompt"
        message = (
            f"the request encodes to {num_bytes} bytes, more than {self.limits.max_event_bytes}"
        )
        return InvalidArgument([FieldViolation(field, message)])

    # on_hold

    @staticmethod
    async def run_size(run: Candidate) -> ApiError | None:
        """A run larger than a limit of the tenant or its key could never be admitted."""
        assert run.held is not None and run.admission is not None
        demand = run.admission.demand()
        for own in (run.held.limits.tenant, run.held.limits.key):
            too_large = oversized(own, demand) if own is not None else None
            if too_large is not None:
                return InvalidArgument([too_large])
        return None

    @staticmethod
    async def quotas(run: Candidate) -> ApiError | None:
        """The first limit of the tenant's, then the key's, that the run would break
        (services.core.quotas.refusal says in which order within one)."""
        held = run.held
        assert held is not None and run.admission is not None
        demand = run.admission.demand()
        for subject, usage in zip(held.subjects, held.snapshot.usages, strict=True):
            refused = refusal(usage, demand)
            if refused is not None:
                return await _exceeded(held.conn, subject, usage, refused, run.admission)
        return None


def _sizes(run: Candidate) -> tuple[int, int]:
    assert run.admission is not None
    return len(run.admission.prompt_token_ids), run.params.sampling.max_tokens


async def _exceeded(
    conn: AsyncConnection,
    subject: Subject,
    usage: SubjectUsage,
    refused: Refusal,
    admission: Admission,
) -> ApiError:
    if refused.reason == MODEL_NOT_PRICED:
        return FailedPrecondition(
            refused.description, MODEL_NOT_PRICED, {"subject": refused.subject}
        )
    retry_after = refused.retry_after
    if retry_after is None:  # a window limit: the wait needs the window's admissions
        entries = await window_entries(conn, subject, usage.now)
        limit = getattr(usage.limits, refused.limit)
        cost = cost_of(refused.limit, admission.demand())
        retry_after = window_wait(entries, refused.limit, limit, cost, usage.now)
    return QuotaExceeded(refused.description, refused.subject, retry_after, refused.reason)
