"""The worker registry: who serves what, how much room each has, who is alive.

Pure bookkeeping; callers pass the time (monotonic seconds).  A worker is
known from configuration (static: kept across outages, alive again once it
answers) or from RegisterWorker (forgotten when lost; it registers again).
A worker id names one process: registering an id that another address holds and
has been heard from within `live_timeout` is refused (`WorkerIdTaken`); the same
address registering again (the worker restarted there) is accepted.
Its free blocks are the last value it reported, lowered locally by every run
assigned since, so dispatch does not pile runs onto one worker between reports. A run
stays held against the worker's reports until one lists it among the worker's runs (the
worker counts its blocks from then on), its assignment fails, or it ends: a report
written before the worker took the run (one that crossed the AssignRun call) would
otherwise hand its blocks out again.
Each report also says which runs the worker holds and which start of its process
(`boot_id`) it comes from; `reported_at` is when the last one arrived.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import structlog

from services.core.shares import Holding, TenantLoad, room_by_share, standing, with_runs

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class WorkerReport:
    """What a worker says about itself (GetWorkerStatus or Heartbeat)."""

    num_free_blocks: int
    running_run_ids: frozenset[str] = frozenset()
    model: str | None = None  # None: not reported
    adapters: frozenset[str] | None = None  # None: not reported
    num_total_blocks: int | None = None
    block_size: int | None = None
    draining: bool = False
    boot_id: str = ""  # "": not reported
    engine_kind: str = ""  # "": not reported
    max_run_tokens: int | None = None  # None: not reported; 0: what the pool holds
    # Each tenant's runs there, and whether runs can be suspended for a tenant's share.
    tenants: tuple[TenantLoad, ...] = ()
    suspends_runs: bool = False


@dataclass(slots=True)
class Worker:
    worker_id: str
    address: str
    model: str = ""  # "" = serves whatever it is sent
    # LoRA adapter model names served beside `model`, on the same KV pool.
    adapters: frozenset[str] = field(default_factory=frozenset)
    static: bool = False
    alive: bool = False
    suspect: bool = False
    draining: bool = False
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    block_size: int = 0
    running_run_ids: frozenset[str] = field(default_factory=frozenset)
    last_seen: float = 0.0
    # When `running_run_ids` were last reported (monotonic seconds; 0: never).
    reported_at: float = 0.0
    boot_id: str = ""
    # What serves its tokens (WorkerStatus.engine_kind); "": not reported.
    engine_kind: str = ""
    # The most tokens one run may hold there, when less than its pool; 0: its pool's.
    max_run_tokens: int = 0
    # Runs reserved here that no report has listed yet (`since`: when reserved).
    held: dict[str, Holding] = field(default_factory=dict)
    # Each tenant's runs as last reported, and whether runs can be suspended there to make
    # room for a tenant under its share (none since it refused a run, until it reports).
    tenants: tuple[TenantLoad, ...] = ()
    suspends_runs: bool = False
    refused_room: bool = False

    def serves(self, model: str) -> bool:
        return not self.model or self.model == model or model in self.adapters

    @property
    def models(self) -> list[str]:
        """The model names it has said it serves: its base, then its adapters."""
        return [self.model, *sorted(self.adapters)] if self.model else []

    def can_take(self, num_kv_blocks: int, model: str) -> bool:
        return self.dispatchable(model) and self.num_free_blocks >= num_kv_blocks

    def dispatchable(self, model: str) -> bool:
        return self.alive and not self.suspect and not self.draining and self.serves(model)

    def room_for(self, num_kv_blocks: int, tenant_id: str, weight: int) -> int:
        """The blocks a run of `tenant_id` would surely find here, suspending runs of
        tenants over their shares where it may (services/core/shares.py); 0 where runs
        are not suspended."""
        if not self.suspends_runs or self.refused_room:
            return 0
        return self.num_free_blocks + room_by_share(
            self.loads, tenant_id, weight, num_kv_blocks, self.capacity
        )

    def within_share(self, tenant_id: str, weight: int, waiting: Mapping[str, int]) -> bool:
        """Whether `tenant_id` holds less than its share here, among the tenants with runs
        here and those `waiting` (tenant -> weight): then it may take one more run, however
        large, so that a run larger than its share waits only for its own tenant's."""
        held, share = standing(self.loads, {**waiting, tenant_id: weight}, self.capacity)
        return len(share) < 2 or held.get(tenant_id, 0) < share[tenant_id]

    @property
    def loads(self) -> list[TenantLoad]:
        """Each tenant's runs here: as last reported, and those on their way since."""
        return with_runs(self.tenants, self.held.values())

    @property
    def capacity(self) -> int:
        return max(self.num_total_blocks, self.num_free_blocks)


class WorkerIdTaken(Exception):
    def __init__(self, worker_id: str, address: str) -> None:
        super().__init__(f"worker id {worker_id!r} is held by a live worker at {address}")
        self.worker_id = worker_id
        self.address = address


class WorkerRegistry:
    """Known workers by id."""

    def __init__(self, live_timeout: float = 5.0) -> None:
        self._workers: dict[str, Worker] = {}
        self.live_timeout = live_timeout
        # A run held that no report listed and that was not seen to end within this long
        # (its end lost with the broker's data) holds nothing any more.
        self.held_timeout = 2 * live_timeout

    def add_static(self, worker_id: str, address: str) -> None:
        """A configured worker: dispatchable once it first answers a status poll."""
        self._workers[worker_id] = Worker(worker_id, address, static=True)

    def register(
        self,
        worker_id: str,
        address: str,
        model: str,
        now: float,
        boot_id: str = "",
        adapters: Iterable[str] = (),
        engine_kind: str = "",
    ) -> None:
        """Adds or renews `worker_id` at `address`; raises WorkerIdTaken (see above)."""
        worker = self._workers.get(worker_id)
        if worker is not None and self._held_elsewhere(worker, address, now):
            raise WorkerIdTaken(worker_id, worker.address)
        if worker is None:
            worker = self._workers[worker_id] = Worker(worker_id, address)
        worker.address = address
        worker.model = model
        worker.adapters = frozenset(adapters)
        worker.engine_kind = engine_kind
        self._boot(worker, boot_id)
        # Free blocks stay unknown (0) until the first heartbeat or status.
        self._see(worker, now)

    def _held_elsewhere(self, worker: Worker, address: str, now: float) -> bool:
        return (
            worker.address != address
            and worker.alive
            and not worker.static
            and now - worker.last_seen <= self.live_timeout
        )

    def heartbeat(self, worker_id: str, report: WorkerReport, now: float) -> bool:
        """Applies a heartbeat; False when the worker is unknown and must register."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return False
        self.observe(worker_id, report, now)
        return True

    def observe(self, worker_id: str, report: WorkerReport, now: float) -> None:
        worker = self._workers.get(worker_id)
        if worker is None:
            return
        self._boot(worker, report.boot_id)
        worker.held = {
            run_id: held
            for run_id, held in worker.held.items()
            if run_id not in report.running_run_ids and now - held.since <= self.held_timeout
        }
        held_blocks = sum(held.num_kv_blocks for held in worker.held.values())
        worker.num_free_blocks = max(0, report.num_free_blocks - held_blocks)
        worker.running_run_ids = report.running_run_ids
        worker.reported_at = now
        worker.draining = report.draining
        worker.tenants = report.tenants
        worker.suspends_runs = report.suspends_runs
        worker.refused_room = False
        if report.model is not None:
            worker.model = report.model
        if report.adapters is not None:
            worker.adapters = report.adapters
        if report.engine_kind:
            worker.engine_kind = report.engine_kind
        if report.max_run_tokens is not None:
            worker.max_run_tokens = report.max_run_tokens
        if report.num_total_blocks is not None:
            worker.num_total_blocks = report.num_total_blocks
        if report.block_size is not None:
            worker.block_size = report.block_size
        self._see(worker, now)

    def _boot(self, worker: Worker, boot_id: str) -> None:
        """Notes the worker's process start; a new one holds none of the runs reported."""
        if not boot_id or boot_id == worker.boot_id:
            return
        if worker.boot_id:
            log.warning("worker restarted", worker_id=worker.worker_id, boot_id=boot_id)
            worker.running_run_ids = frozenset()
        worker.boot_id = boot_id

    def has_dropped(self, worker_id: str, run_id: str, since: float) -> bool:
        """Whether the live worker's last report, received after `since`, leaves `run_id`
        out. Unknown or lost workers are the liveness timeout's business."""
        worker = self._workers.get(worker_id)
        return (
            worker is not None
            and worker.alive
            and worker.reported_at > since
            and run_id not in worker.running_run_ids
        )

    def _see(self, worker: Worker, now: float) -> None:
        worker.alive = True
        worker.suspect = False
        worker.last_seen = now

    def mark_suspect(self, worker_id: str) -> None:
        """No dispatch to it until it is heard from again."""
        if worker_id in self._workers:
            self._workers[worker_id].suspect = True

    def mark_full(self, worker_id: str, num_kv_blocks: int) -> None:
        """It refused a run of `num_kv_blocks` blocks: it has less room than that, and
        none by suspending runs until it reports again."""
        worker = self._workers.get(worker_id)
        if worker is not None:
            worker.num_free_blocks = min(worker.num_free_blocks, num_kv_blocks - 1)
            worker.refused_room = True

    def reserve(self, worker_id: str, run: Holding) -> None:
        """Holds the run's blocks of the worker's, until a report lists it (`run.since`:
        now). Its tenant counts them there meanwhile, for shares."""
        worker = self._workers.get(worker_id)
        if worker is not None:
            worker.num_free_blocks = max(0, worker.num_free_blocks - run.num_kv_blocks)
            worker.held[run.run_id] = run

    def release(self, worker_id: str, run_id: str) -> None:
        """Gives back what `reserve` took for a run the worker did not take."""
        worker = self._workers.get(worker_id)
        held = worker.held.pop(run_id, None) if worker is not None else None
        if worker is not None and held is not None:
            worker.num_free_blocks = min(
                worker.capacity, worker.num_free_blocks + held.num_kv_blocks
            )

    def run_ended(self, run_id: str) -> None:
        """`run_id` holds no blocks any more, wherever it was reserved; the next report
        of its worker counts them free."""
        for worker in self._workers.values():
            worker.held.pop(run_id, None)

    def choose(
        self,
        num_kv_blocks: int,
        model: str,
        tenant_id: str = "",
        weight: int = 1,
        waiting: Mapping[str, int] | None = None,
    ) -> Worker | None:
        """The dispatchable worker with the most free blocks that fits `num_kv_blocks`;
        while other tenants' runs are `waiting` (tenant -> weight), not one that cannot
        suspend runs where `tenant_id` holds its share already."""
        fitting = [
            w
            for w in self._workers.values()
            if w.can_take(num_kv_blocks, model)
            and (not waiting or w.suspends_runs or w.within_share(tenant_id, weight, waiting))
        ]
        return max(fitting, key=lambda w: (w.num_free_blocks, w.worker_id), default=None)

    def choose_making_room(
        self, num_kv_blocks: int, model: str, tenant_id: str, weight: int
    ) -> Worker | None:
        """Where an interactive run of `tenant_id` that fits no worker's free blocks would
        have runs of tenants over their shares suspended to make room: the dispatchable
        worker with the most room so, or None."""
        rooms = [
            (w.room_for(num_kv_blocks, tenant_id, weight), w.worker_id, w)
            for w in self._workers.values()
            if w.dispatchable(model)
        ]
        best = max(rooms, default=None, key=lambda room: room[:2])
        return best[2] if best is not None and best[0] >= num_kv_blocks else None

    def may_ever_fit(self, num_kv_blocks: int, model: str) -> bool:
        """Whether some live worker serving `model` could hold `num_kv_blocks` once idle."""
        return any(
            w.alive and w.serves(model) and w.capacity >= num_kv_blocks
            for w in self._workers.values()
        )

    def serves_any(self, model: str) -> bool:
        """Whether some live worker serves `model`."""
        return any(w.alive and w.serves(model) for w in self._workers.values())

    def max_run_tokens(self) -> dict[str, int]:
        """Per model, the most tokens one run may hold on the live workers that serve it
        (those that have said their model and block size): the largest pool's, or less
        where a worker's engine takes less per run (`Worker.max_run_tokens`)."""
        largest: dict[str, int] = {}
        for w in self.alive():
            if w.block_size:
                tokens = w.capacity * w.block_size
                if w.max_run_tokens:
                    tokens = min(tokens, w.max_run_tokens)
                for model in w.models:
                    largest[model] = max(largest.get(model, 0), tokens)
        return largest

    def expire(self, now: float, timeout: float) -> list[str]:
        """Marks workers unheard of for `timeout` seconds as lost; returns their ids."""
        lost = [
            w.worker_id for w in self._workers.values() if w.alive and now - w.last_seen > timeout
        ]
        for worker_id in lost:
            if self._workers[worker_id].static:
                self._workers[worker_id].alive = False
            else:
                del self._workers[worker_id]
        return lost

    def get(self, worker_id: str) -> Worker | None:
        return self._workers.get(worker_id)

    def is_alive(self, worker_id: str) -> bool:
        worker = self._workers.get(worker_id)
        return worker is not None and worker.alive

    def all(self) -> list[Worker]:
        return list(self._workers.values())

    def alive(self) -> Iterable[Worker]:
        return (w for w in self._workers.values() if w.alive)

    def num_free_blocks(self) -> int:
        return sum(w.num_free_blocks for w in self.alive())
