from engine.outputs import RequestOutput
from services.core.eventstore import EventStore
from services.core.runs import NewEvent, NewRun, RunState
from services.worker.appender import StepAppender
from services.worker.runs import AssignedRun
from tests.services.worker.test_runs import METRICS


async def started_run(store: EventStore, run_id: str) -> AssignedRun:
    await store.append(run_id, 0, [NewEvent(RunState.QUEUED)], new_run=NewRun("t1", "tiny"))
    epoch = await store.acquire_lease(run_id, "worker-1")
    await store.append(run_id, 1, [NewEvent(RunState.PREFILL)], lease_epoch=epoch)
    return AssignedRun(run_id=run_id, tenant_id="t1", lease_epoch=epoch, last_seq=2)


def out(run_id: str, token: int, reason: str | None = None) -> RequestOutput:
    return RequestOutput(run_id, (token,), "x", reason is not None, reason, METRICS)


async def test_steps_append_in_order_and_a_fenced_run_is_dropped(store: EventStore) -> None:
    runs = {"a": await started_run(store, "a"), "b": await started_run(store, "b")}
    aborted: list[str] = []
    appender = StepAppender(store, runs, aborted.append)
    await appender.append([out("a", 1), out("b", 1)])
    # Another owner takes run b over: the worker's next append for it is refused.
    await store.acquire_lease("b", "worker-2")
    await appender.append([out("a", 2, "length"), out("b", 2)])
    assert [e.kind for e in await store.read("a")] == [
        "queued",
        "prefill",
        "streaming",
        "streaming",
        "completed",
    ]
    assert [e.kind for e in await store.read("b")] == ["queued", "prefill", "streaming"]
    assert aborted == ["b"]
    assert runs == {}  # a finished, b was dropped
