"""The scheduler's memory of ended runs (pure: no database, no broker)."""

from collections.abc import Collection

from services.scheduler.intake import Intake
from services.scheduler.records import QueuedRun
from services.scheduler.state import SchedulerState
from services.scheduler.workers import WorkerRegistry


class RecordingRepository:
    """Records which runs intake asks the database about; none is queued."""

    block_size = 16

    def __init__(self) -> None:
        self.asked: list[list[str]] = []

    async def load_queued(self, run_ids: Collection[str]) -> list[QueuedRun]:
        self.asked.append(list(run_ids))
        return []


async def test_a_late_queued_event_of_an_ended_run_costs_no_query() -> None:
    state = SchedulerState(WorkerRegistry())
    repository = RecordingRepository()
    state.forget("run_ended")
    taken = await Intake(state, repository).take(["run_ended", "run_new"])  # type: ignore[arg-type]
    assert taken == 0
    assert repository.asked == [["run_new"]]


def test_only_the_latest_ends_are_remembered() -> None:
    state = SchedulerState(WorkerRegistry(), max_remembered_ended=2)
    for run_id in ("a", "b", "c"):
        state.forget(run_id)
    assert [state.knows(run_id) for run_id in ("a", "b", "c")] == [False, True, True]


def test_ending_one_assignment_is_not_an_end_of_the_run() -> None:
    state = SchedulerState(WorkerRegistry())
    state.forget("requeued", lease_epoch=3)
    assert not state.knows("requeued")
