"""The worker's core: accept, cancel and report runs on one engine."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import structlog

from engine.errors import RequestError
from engine.front import EngineFront
from engine.sampling import Priority, SamplingParams, blocks_for_run
from services.core.errors import FailedPrecondition, ResourceExhausted, Unavailable
from services.core.event_store import EventStore
from services.core.loop import wait_set
from services.core.requeue import prefill_event
from services.core.runs import EventStoreError, NewEvent, RunState
from services.core.shares import Holding, TenantLoad, make_room, tenant_loads, to_resume
from services.worker.metrics import PREEMPTIONS, RUNNING, observe_pool
from services.worker.runs import AssignedRun
from services.worker.telemetry import start_run_span

log = structlog.get_logger(__name__)

RESUME_INTERVAL_S = 1.0


@dataclass(frozen=True, slots=True)
class Assignment:
    run_id: str
    tenant_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: Priority
    lease_epoch: int
    last_seq: int
    cache_namespace: str
    traceparent: str = ""
    tenant_weight: int = 1


@dataclass(frozen=True, slots=True)
class Status:
    worker_id: str
    model: str
    adapters: list[str]
    num_free_blocks: int
    num_total_blocks: int
    block_size: int
    running_run_ids: list[str]
    draining: bool
    boot_id: str
    engine_kind: str
    max_run_tokens: int = 0  # 0: what the pool holds
    tenants: list[TenantLoad] = field(default_factory=list)
    suspends_runs: bool = False


class WorkerCore:
    def __init__(
        self,
        worker_id: str,
        model: str,
        engine: EngineFront,
        store: EventStore,
        start_run: Callable[[str, NewEvent], None],
        runs: dict[str, AssignedRun] | None = None,
        drop_run: Callable[[str], None] | None = None,
        adapters: Sequence[str] = (),
        engine_kind: str = "builtin",
    ) -> None:
        """`start_run` appends a newly assigned run's `prefill` (the StepAppender's start);
        `drop_run` stops a run without appending anything more for it (its `drop`).
        `adapters` are the model names of the engine's LoRA adapters, served beside
        `model` (the base)."""
        self.worker_id = worker_id
        self.model = model
        self.adapters = list(adapters)
        self.engine_kind = engine_kind
        self.engine = engine
        self.store = store
        self.start_run = start_run
        self.drop_run = drop_run or self._drop
        # Tells the scheduler this process apart from an earlier one under the same id.
        self.boot_id = uuid.uuid4().hex
        # Shared with the StepAppender, which removes runs as they end.
        self.runs: dict[str, AssignedRun] = runs if runs is not None else {}
        RUNNING.watch(model, self.runs)
        self.draining = False
        # False while a new engine replaces one that died: no runs are taken meanwhile.
        self.engine_ready = True

    async def assign(self, assignment: Assignment) -> None:
        """Hands the run to the engine and has its `prefill` appended under its lease."""
        held = self.runs.get(assignment.run_id)
        if held is not None:
            self._check_newer(held, assignment)
            return  # a retried AssignRun
        if self.draining:
            raise Unavailable("the worker is draining", retry_after=1.0)
        if not self.engine_ready:
            raise Unavailable("the worker's engine is restarting", retry_after=1.0)
        if self.engine.has_request(assignment.run_id):
            raise Unavailable("an earlier attempt of the run is still stopping", retry_after=0.1)
        if assignment.model != self.model and assignment.model not in self.adapters:
            served = ", ".join(map(repr, [self.model, *self.adapters]))
            raise FailedPrecondition(f"this worker serves {served}", "WRONG_MODEL")
        sampling = assignment.sampling
        needed = blocks_for_run(
            len(assignment.prompt_token_ids),
            sampling.max_tokens,
            sampling.n,
            self.engine.limits.block_size,
        )
        if self.is_full:
            raise ResourceExhausted("the engine runs as many runs as it takes")
        victims = self._make_room(assignment, needed)
        span, traceparent = start_run_span(
            assignment.run_id,
            assignment.tenant_id,
            assignment.model,
            assignment.sampling.max_tokens,
            assignment.traceparent,
        )
        # Held before the first await, so concurrent assignments cannot overbook.
        run = self.runs[assignment.run_id] = AssignedRun(
            run_id=assignment.run_id,
            tenant_id=assignment.tenant_id,
            lease_epoch=assignment.lease_epoch,
            last_seq=assignment.last_seq,
            traceparent=traceparent,
            model=assignment.model,
            assigned_at=time.monotonic(),
            span=span,
            num_kv_blocks=needed,
            num_answers=sampling.n,
            weight=max(1, assignment.tenant_weight),
            interactive=assignment.priority == Priority.INTERACTIVE,
        )
        prefill = prefill_event(self.worker_id, assignment.lease_epoch)
        try:
            self.engine.add_request(
                assignment.run_id,
                assignment.prompt_token_ids,
                assignment.sampling,
                cache_namespace=assignment.cache_namespace,
                priority=assignment.priority,
                adapter="" if assignment.model == self.model else assignment.model,
            )
        except RequestError as error:
            del self.runs[assignment.run_id]
            await self._fail(run, prefill, str(error))
            return
        # Only once the engine took it: the engine applies these before its next step, so
        # the run waits in its queue at most a step for the blocks they free.
        for victim in victims:
            self._suspend(self.runs[victim], assignment.tenant_id)
        # The engine starts now; `prefill` is appended with the next batch, which puts the
        # lease to the test: if it is stale, the append is refused and the run dropped.
        self.start_run(assignment.run_id, prefill)
        log.info("run assigned", run_id=assignment.run_id, tenant_id=assignment.tenant_id)

    def _make_room(self, assignment: Assignment, needed: int) -> list[str]:
        """The runs to suspend so that the assignment fits (none where it fits without);
        raises ResourceExhausted where it does not fit and none may be suspended for it."""
        if needed <= self.num_free_blocks:
            return []
        victims = None
        if self.engine.suspends:
            running = [_holding(run) for run in self.runs.values() if run.suspended_at is None]
            incoming = Holding(
                assignment.run_id,
                assignment.tenant_id,
                max(1, assignment.tenant_weight),
                needed,
                interactive=assignment.priority == Priority.INTERACTIVE,
            )
            total = self.engine.limits.num_total_blocks
            victims = make_room(running, incoming, self._num_unheld_blocks, total)
        if victims is None:
            raise ResourceExhausted(f"needs {needed} KV blocks, {self.num_free_blocks} are free")
        return victims

    def _suspend(self, run: AssignedRun, for_tenant: str) -> None:
        run.suspended_at = time.monotonic()
        run.num_suspensions += 1
        self.engine.suspend(run.run_id)
        PREEMPTIONS.labels(self.model, "share").inc()
        log.info("run suspended for another tenant's", run_id=run.run_id, for_tenant=for_tenant)

    def resume_what_fits(self) -> None:
        """Lets suspended runs go on, the longest suspended first, while the blocks that
        no running run holds take them."""
        suspended = [run for run in self.runs.values() if run.suspended_at is not None]
        suspended.sort(key=lambda run: run.suspended_at or 0.0)
        for run_id in to_resume([_holding(run) for run in suspended], self._num_unheld_blocks):
            self.runs[run_id].suspended_at = None
            self.engine.resume(run_id)
            log.info("suspended run resumed", run_id=run_id)

    @property
    def _num_unheld_blocks(self) -> int:
        """Blocks that no running run holds: those a suspended one left count free."""
        running = [run for run in self.runs.values() if run.suspended_at is None]
        return self.engine.limits.num_total_blocks - sum(run.num_kv_blocks for run in running)

    def _check_newer(self, held: AssignedRun, assignment: Assignment) -> None:
        """A newer lease for a run held under an older one: the run was taken back and
        assigned again (this worker's appends for it are fenced off by now). The old
        attempt is dropped and the scheduler told to retry, which then starts it anew."""
        if assignment.lease_epoch <= held.lease_epoch:
            return
        log.warning(
            "newer lease for a held run; dropping the old attempt",
            run_id=held.run_id,
            held_epoch=held.lease_epoch,
            lease_epoch=assignment.lease_epoch,
        )
        self.drop_run(held.run_id)
        raise Unavailable("the worker held an older attempt of this run; retry", retry_after=0.1)

    def _drop(self, run_id: str) -> None:
        if self.runs.pop(run_id, None) is not None:
            self.engine.abort(run_id)

    async def _fail(self, run: AssignedRun, prefill: NewEvent, message: str) -> None:
        failed = NewEvent(
            RunState.FAILED, {"code": "ENGINE_REJECTED", "message": message, "usage": {}}
        )
        try:
            await self.store.append(
                run.run_id, run.last_seq, [prefill, failed], lease_epoch=run.lease_epoch
            )
        except EventStoreError as error:
            raise FailedPrecondition(
                f"the run cannot start: {error}", "RUN_NOT_STARTABLE"
            ) from None

    def cancel(self, run_id: str, reason: str) -> bool:
        """Aborts the run in the engine; its `cancelled` event follows with the next step."""
        run = self.runs.get(run_id)
        if run is None:
            return False
        run.cancel_reason = reason or "cancelled"
        self.engine.abort(run_id)
        return True

    @property
    def num_free_blocks(self) -> int:
        """Blocks not promised to a run: each may grow to its full length, and a suspended
        one is promised its blocks back before a new run takes them, but for an
        interactive run of a tenant within its share (`_make_room`)."""
        reserved = sum(run.num_kv_blocks for run in self.runs.values())
        return max(0, self.engine.limits.num_total_blocks - reserved)

    @property
    def is_full(self) -> bool:
        """Whether the engine takes no run more whatever its blocks: it runs its most
        runs, or (an engine server others share) it holds back requests already."""
        limit = self.engine.max_running
        return (limit is not None and len(self.runs) >= limit) or self.engine.saturated

    def status(self) -> Status:
        """What the scheduler reads: a worker without an engine has no room and says it is
        draining, so that nothing is dispatched to it until its new engine is ready."""
        limits = self.engine.limits
        observe_pool(
            self.model,
            self.worker_id,
            self.engine.num_free_blocks,
            limits.num_total_blocks,
            self.num_free_blocks,
        )
        return Status(
            worker_id=self.worker_id,
            model=self.model,
            adapters=self.adapters,
            num_free_blocks=self.num_free_blocks if self.engine_ready and not self.is_full else 0,
            num_total_blocks=limits.num_total_blocks,
            block_size=limits.block_size,
            running_run_ids=sorted(self.runs),
            draining=self.draining or not self.engine_ready,
            boot_id=self.boot_id,
            engine_kind=self.engine_kind,
            max_run_tokens=self.engine.max_run_tokens or 0,
            tenants=self.tenant_loads(),
            suspends_runs=self.engine.suspends,
        )

    def tenant_loads(self) -> list[TenantLoad]:
        """Each tenant's runs here: the running ones' blocks, and the suspended."""
        runs = list(self.runs.values())
        return tenant_loads(
            [_holding(run) for run in runs if run.suspended_at is None],
            [_holding(run) for run in runs if run.suspended_at is not None],
        )


async def resume_suspended(core: WorkerCore, runs_ended: asyncio.Event) -> None:
    """Resumes suspended runs as runs end here, and every RESUME_INTERVAL_S for those
    dropped or failed without an end of their own."""
    while True:
        await wait_set(runs_ended, RESUME_INTERVAL_S)
        runs_ended.clear()
        core.resume_what_fits()


def _holding(run: AssignedRun) -> Holding:
    return Holding(
        run.run_id,
        run.tenant_id,
        run.weight,
        run.num_kv_blocks,
        interactive=run.interactive,
        since=run.assigned_at,
        suspendable=run.num_answers == 1,
    )
