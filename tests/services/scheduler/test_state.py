"""The scheduler's memory of ended runs, and the load it reports (pure: no database, no
broker)."""

from collections.abc import Collection
from datetime import UTC, datetime

from services.core.runs import RunState, StoredEvent
from services.core.shares import TenantLoad
from services.scheduler.fair_queue import QueueClass
from services.scheduler.intake import Intake
from services.scheduler.records import Assignment, QueuedRun
from services.scheduler.state import SchedulerState
from services.scheduler.workers import WorkerRegistry, WorkerReport


class RecordingStore:
    """Records which runs intake asks the database about; none is queued."""

    block_size = 16

    def __init__(self) -> None:
        self.asked: list[list[str]] = []

    async def load_queued(self, run_ids: Collection[str]) -> list[QueuedRun]:
        self.asked.append(list(run_ids))
        return []


async def test_a_late_queued_event_of_an_ended_run_costs_no_query() -> None:
    state = SchedulerState(WorkerRegistry())
    scheduler_store = RecordingStore()
    state.forget("run_ended")
    taken = await Intake(state, scheduler_store).take(["run_ended", "run_new"])  # type: ignore[arg-type]
    assert taken == 0
    assert scheduler_store.asked == [["run_new"]]


def queued_event(run_id: str, seq: int) -> StoredEvent:
    return StoredEvent(run_id, seq, RunState.QUEUED, "t", {}, datetime.now(UTC))


async def test_only_a_queued_event_that_may_bring_a_run_back_costs_a_query() -> None:
    state = SchedulerState(WorkerRegistry())
    scheduler_store = RecordingStore()
    state.enqueue(queued("waiting", QueueClass.INTERACTIVE, 1))
    for run_id in ("assigned", "handed_back"):
        state.settle(run_id, Assignment(run_id, "t", "w1", 1, 0.0, last_seq=1))
    events = [
        queued_event("waiting", 1),
        queued_event("assigned", 1),  # its first event, behind admission's hint
        queued_event("handed_back", 3),  # queued again after its lease
        queued_event("unknown", 1),
    ]
    assert await Intake(state, scheduler_store).take_events(events) == 0  # type: ignore[arg-type]
    assert scheduler_store.asked == [["handed_back", "unknown"]]


def test_only_the_latest_ends_are_remembered() -> None:
    state = SchedulerState(WorkerRegistry(), max_remembered_ended=2)
    for run_id in ("a", "b", "c"):
        state.forget(run_id)
    assert [state.knows(run_id) for run_id in ("a", "b", "c")] == [False, True, True]


def test_ending_one_assignment_is_not_an_end_of_the_run() -> None:
    state = SchedulerState(WorkerRegistry())
    state.forget("requeued", lease_epoch=3)
    assert not state.knows("requeued")


def queued(run_id: str, queue_class: QueueClass, num_kv_blocks: int) -> QueuedRun:
    return QueuedRun(
        run_id, "t", "m", queue_class, 1, {}, "", 0.0, 0.0, weight=1, num_kv_blocks=num_kv_blocks
    )


def test_stats_give_the_fleet_size_and_the_blocks_each_class_waits_for() -> None:
    registry = WorkerRegistry()
    registry.add_static("w1", "host:1")
    registry.observe("w1", WorkerReport(num_free_blocks=10, num_total_blocks=64), now=0.0)
    state = SchedulerState(registry)
    state.enqueue(queued("i1", QueueClass.INTERACTIVE, 3))
    state.enqueue(queued("i2", QueueClass.INTERACTIVE, 4))
    state.enqueue(queued("b1", QueueClass.BATCH, 20))
    stats = state.stats()
    assert (stats.num_interactive, stats.num_batch) == (2, 1)
    assert (stats.num_free_blocks, stats.num_total_blocks) == (10, 64)
    assert (stats.num_queued_interactive_blocks, stats.num_queued_batch_blocks) == (7, 20)


def of_tenant(run_id: str, tenant: str, queue_class: QueueClass, blocks: int) -> QueuedRun:
    return QueuedRun(
        run_id, tenant, "m", queue_class, 1, {}, "", 0.0, 0.0, weight=1, num_kv_blocks=blocks
    )


def flooded(suspends_runs: bool = True) -> SchedulerState:
    """One worker of 64 blocks, all of them the flood's (16 runs), none free."""
    registry = WorkerRegistry()
    registry.add_static("w1", "host:1")
    flood = (TenantLoad("flood", 1, 64, 16, num_suspendable_blocks=64),)
    registry.observe(
        "w1",
        WorkerReport(0, num_total_blocks=64, tenants=flood, suspends_runs=suspends_runs),
        now=0.0,
    )
    return SchedulerState(registry)


def test_an_interactive_run_under_its_share_goes_where_runs_would_make_room() -> None:
    state = flooded()
    state.enqueue(of_tenant("more", "flood", QueueClass.INTERACTIVE, 2))
    state.enqueue(of_tenant("batch", "light", QueueClass.BATCH, 2))
    assert state.take_next(now=0.0) is None  # the flood alone, a batch run: no room
    state.enqueue(of_tenant("light", "light", QueueClass.INTERACTIVE, 2))
    taken = state.take_next(now=0.0)
    assert taken is not None and taken.run_id == "light"
    assert state.take_next(now=0.0) is None
    state.registry.mark_full("w1", 2)  # the worker refused it: none until it reports
    state.put_back(taken)
    assert state.take_next(now=0.0) is None


def test_a_run_on_its_way_counts_for_its_tenant_before_the_worker_reports_it() -> None:
    registry = WorkerRegistry()
    registry.add_static("w1", "host:1")
    idle = WorkerReport(64, num_total_blocks=64, suspends_runs=True)
    registry.observe("w1", idle, now=0.0)
    state = SchedulerState(registry)
    state.enqueue(of_tenant("flood", "flood", QueueClass.BATCH, 60))
    flood = state.take_next(now=0.0)
    assert flood is not None
    registry.reserve("w1", flood.holding(since=0.0))
    # Its blocks are taken at once, and the flood is over its share of them at once: the
    # light tenant's interactive run need not wait for the worker's next report.
    state.enqueue(of_tenant("light", "light", QueueClass.INTERACTIVE, 8))
    taken = state.take_next(now=0.0)
    assert taken is not None and taken.run_id == "light"
    registry.mark_full("w1", 8)  # the worker refused it: no room made until it reports
    state.put_back(taken)
    assert state.take_next(now=0.0) is None
    registry.observe("w1", idle, now=1.0)  # crossed the flood's assignment: still held
    assert (again := state.take_next(now=1.0)) is not None and again.run_id == "light"


def test_no_room_is_made_on_a_worker_that_does_not_suspend_or_past_a_share() -> None:
    state = flooded(suspends_runs=False)
    state.enqueue(of_tenant("light", "light", QueueClass.INTERACTIVE, 2))
    assert state.take_next(now=0.0) is None
    state = flooded()
    state.enqueue(of_tenant("big", "light", QueueClass.INTERACTIVE, 33))  # over its 32
    assert state.take_next(now=0.0) is None


def test_where_runs_cannot_be_suspended_a_tenant_past_its_share_waits_while_others_do() -> None:
    registry = WorkerRegistry()
    registry.add_static("w1", "host:1")
    flood = (TenantLoad("flood", 1, 40, 10),)
    registry.observe("w1", WorkerReport(24, num_total_blocks=64, tenants=flood), now=0.0)
    state = SchedulerState(registry)
    state.enqueue(of_tenant("more", "flood", QueueClass.INTERACTIVE, 4))
    state.enqueue(of_tenant("light-big", "light", QueueClass.INTERACTIVE, 40))  # over its 32
    # The flood's run would take it to 44 of its 32 blocks while the light tenant waits.
    assert state.take_next(now=0.0) is None
    state.dequeue("light-big")
    taken = state.take_next(now=0.0)  # nobody else waits: all of the worker is the flood's
    assert taken is not None and taken.run_id == "more"
    state.enqueue(of_tenant("light", "light", QueueClass.INTERACTIVE, 4))
    assert (taken := state.take_next(now=0.0)) is not None and taken.run_id == "light"
