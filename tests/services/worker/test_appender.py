import asyncio
from collections.abc import Callable, Sequence

from sqlalchemy.exc import OperationalError

from engine.outputs import RequestOutput
from services.core.event_store import Append, EventStore
from services.core.runs import NewEvent, NewRun, RunState, StoredEvent
from services.worker.appender import APPEND_FAILED, StepAppender
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
    appender.on_step([out("a", 1), out("b", 1)])
    await appender.flush()
    # Another owner takes run b over: the worker's next append for it is refused.
    await store.acquire_lease("b", "worker-2")
    appender.on_step([out("a", 2, "length"), out("b", 2)])
    await appender.flush()
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


async def test_steps_within_the_interval_share_an_event_and_first_or_last_tokens_go_at_once(
    store: EventStore,
) -> None:
    runs = {"a": await started_run(store, "a")}
    # An interval no test would wait out: only urgent outputs can get anything appended.
    appender = StepAppender(
        store, runs, lambda run_id: None, events_per_second=1e-6, max_interval=60.0
    )
    task = asyncio.create_task(appender.run())
    try:
        appender.on_step([out("a", 1)])  # the run's first tokens
        await wait_until(lambda: runs["a"].streamed)
        appender.on_step([out("a", 2)])
        appender.on_step([out("a", 3)])
        appender.on_step([out("a", 4, "length")])  # the run's end
        await wait_until(lambda: not runs)
    finally:
        task.cancel()
    events = await store.read("a")
    assert [(e.kind, e.payload.get("token_ids")) for e in events[2:]] == [
        ("streaming", [1]),
        ("streaming", [2, 3, 4]),
        ("completed", None),
    ]


async def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


async def assigned(store: EventStore, run_id: str) -> AssignedRun:
    await store.append(run_id, 0, [NewEvent(RunState.QUEUED)], new_run=NewRun("t1", "tiny"))
    epoch = await store.acquire_lease(run_id, "worker-1")
    return AssignedRun(run_id=run_id, tenant_id="t1", lease_epoch=epoch, last_seq=1)


async def test_prefill_goes_out_alone_when_tokens_are_late_and_a_stale_lease_drops_the_run(
    store: EventStore,
) -> None:
    runs = {"a": await assigned(store, "a"), "b": await assigned(store, "b")}
    await store.acquire_lease("b", "worker-2")  # b's lease moved on before it started here
    aborted: list[str] = []
    appender = StepAppender(
        store, runs, aborted.append, events_per_second=1e-6, min_interval=0.05, max_interval=60.0
    )
    task = asyncio.create_task(appender.run())
    try:
        appender.start("a", NewEvent(RunState.PREFILL))
        appender.start("b", NewEvent(RunState.PREFILL))
        await wait_until(lambda: runs["a"].last_seq == 2 and "b" not in runs)
        appender.on_step([out("a", 1, "length")])
        await wait_until(lambda: not runs)
    finally:
        task.cancel()
    assert [e.kind for e in await store.read("a")] == [
        "queued",
        "prefill",
        "streaming",
        "completed",
    ]
    assert [e.kind for e in await store.read("b")] == ["queued"]
    assert aborted == ["b"]


async def test_prefill_and_first_tokens_in_time_share_one_append(store: EventStore) -> None:
    runs = {"a": await assigned(store, "a")}
    appended: list[list[str]] = []
    append_batch = store.append_batch

    async def counted(appends: Sequence[Append]) -> list[StoredEvent]:
        appended.append([e.kind for a in appends for e in a.events])
        return await append_batch(appends)

    store.append_batch = counted  # type: ignore[method-assign]
    appender = StepAppender(store, runs, lambda run_id: None, min_interval=30.0)
    task = asyncio.create_task(appender.run())
    try:
        appender.start("a", NewEvent(RunState.PREFILL))
        await asyncio.sleep(0.1)
        assert appended == []  # waiting for the first tokens
        appender.on_step([out("a", 1)])
        await wait_until(lambda: runs["a"].streamed)
    finally:
        task.cancel()
    assert appended == [["prefill", "streaming"]]
    assert [e.kind for e in await store.read("a")] == ["queued", "prefill", "streaming"]


def test_the_interval_grows_with_the_runs_held_between_its_bounds() -> None:
    runs: dict[str, AssignedRun] = {}
    appender = StepAppender(None, runs, lambda run_id: None, events_per_second=100.0)  # type: ignore[arg-type]
    assert appender.interval() == 0.05
    for i in range(8):
        runs[str(i)] = AssignedRun(run_id=str(i), tenant_id="t", lease_epoch=1, last_seq=1)
    assert appender.interval() == 0.08
    for i in range(8, 100):
        runs[str(i)] = AssignedRun(run_id=str(i), tenant_id="t", lease_epoch=1, last_seq=1)
    assert appender.interval() == 0.25


async def test_an_append_whose_commit_reply_was_lost_goes_on_with_every_run(
    store: EventStore,
) -> None:
    runs = {"a": await started_run(store, "a"), "b": await started_run(store, "b")}
    append_batch = store.append_batch
    replies_lost = 0

    async def reply_lost_once(appends: Sequence[Append]) -> list[StoredEvent]:
        nonlocal replies_lost
        stored = await append_batch(appends)
        if not replies_lost:
            replies_lost += 1
            # The transaction committed; the connection broke before its reply came back.
            raise OperationalError("COMMIT", None, ConnectionError("server closed the connection"))
        return stored

    store.append_batch = reply_lost_once  # type: ignore[method-assign]
    aborted: list[str] = []
    appender = StepAppender(store, runs, aborted.append)
    task = asyncio.create_task(appender.run())
    try:
        appender.on_step([out("a", 1), out("b", 1)])
        await appender.flush()
        appender.on_step([out("a", 2, "length"), out("b", 2, "length")])
        await wait_until(lambda: not runs)
    finally:
        task.cancel()
    assert replies_lost == 1
    assert aborted == []
    for run_id in ("a", "b"):
        events = await store.read(run_id)
        assert [(e.kind, e.payload.get("token_ids")) for e in events[2:]] == [
            ("streaming", [1]),
            ("streaming", [2]),
            ("completed", None),
        ]
    assert runs == {}


async def test_what_an_earlier_attempt_of_a_run_produced_is_not_appended_for_a_later_one(
    store: EventStore,
) -> None:
    earlier = await started_run(store, "a")
    runs = {"a": earlier}
    appender = StepAppender(store, runs, lambda run_id: None, min_interval=60.0)
    appender.on_step([out("a", 1)])  # produced for the earlier attempt, not appended yet
    appender.drop("a")
    # The run is assigned here again under a newer lease.
    epoch = await store.acquire_lease("a", "worker-1")
    runs["a"] = AssignedRun(run_id="a", tenant_id="t1", lease_epoch=epoch, last_seq=2)
    task = asyncio.create_task(appender.run())
    try:
        await appender.flush()
        appender.on_step([out("a", 9, "length")])
        await wait_until(lambda: not runs)
    finally:
        task.cancel()
    events = await store.read("a")
    assert [(e.kind, e.payload.get("token_ids")) for e in events[2:]] == [
        ("streaming", [9]),
        ("completed", None),
    ]


async def test_watchers_hear_when_a_run_ends_and_not_before(store: EventStore) -> None:
    runs = {"a": await started_run(store, "a"), "b": await started_run(store, "b")}
    appender = StepAppender(store, runs, lambda run_id: None)
    first, second = appender.watch_ended(), appender.watch_ended()
    appender.on_step([out("a", 1), out("b", 1)])
    await appender.flush()
    assert not first.is_set() and not second.is_set()  # tokens, no run ended
    appender.on_step([out("a", 2, "length")])
    await appender.flush()
    assert first.is_set() and second.is_set()
    first.clear()
    appender.drop("b")  # a dropped run frees its blocks as well
    assert first.is_set()


async def test_a_failed_append_tells_each_tenant_a_code_and_no_detail(store: EventStore) -> None:
    runs = {"a": await started_run(store, "a"), "b": await started_run(store, "b")}
    append_batch = store.append_batch
    detail = "INSERT INTO run_events ... VALUES ('other tenant prompt', 'b')"

    async def refused_for_good(appends: Sequence[Append]) -> list[StoredEvent]:
        await append_batch([])  # the database answers; it is the statement that fails
        raise ValueError(detail)

    store.append_batch = refused_for_good  # type: ignore[method-assign]
    appender = StepAppender(store, runs, lambda run_id: None)
    task = asyncio.create_task(appender.run())
    try:
        appender.on_step([out("a", 1), out("b", 1)])
        # Until the step is done with: each run is let go before its `failed` is stored.
        await asyncio.wait_for(appender.flush(), 30)
    finally:
        task.cancel()
    assert not runs
    for run_id in ("a", "b"):
        [*_, failed] = await store.read(run_id)
        assert failed.kind == RunState.FAILED
        assert failed.payload == {"code": "INTERNAL", "message": APPEND_FAILED}


async def test_a_run_is_stored_every_so_many_tokens_and_each_step_goes_live_between(
    store: EventStore,
) -> None:
    runs = {"a": await started_run(store, "a")}
    live: list[tuple[str, list[dict[str, object]]]] = []
    appender = StepAppender(
        store,
        runs,
        lambda run_id: None,
        publish=lambda run_id, tenant_id, pieces: live.append((run_id, list(pieces))),
        min_interval=0.0,
        store_tokens=4,
        store_interval=60.0,
    )
    task = asyncio.create_task(appender.run())
    try:
        appender.on_step([out("a", 1)])  # the first tokens: stored at once, not live
        await wait_until(lambda: runs["a"].streamed)
        for token in range(2, 11):
            appender.on_step([out("a", token)])
            await asyncio.sleep(0.01)
        await wait_until(lambda: runs["a"].stored == (9, 9))
        await asyncio.sleep(0.05)
        assert runs["a"].pending == [out("a", 10)]  # under four tokens: not due yet
        appender.on_step([out("a", 11, "length")])
        await wait_until(lambda: not runs)
    finally:
        task.cancel()
    stored = [
        (e.kind, e.payload.get("token_ids"), e.payload.get("at")) for e in await store.read("a")
    ]
    assert stored[2:] == [
        ("streaming", [1], [0, 0]),
        ("streaming", [2, 3, 4, 5], [1, 1]),
        ("streaming", [6, 7, 8, 9], [5, 5]),
        ("streaming", [10, 11], [9, 9]),
        ("completed", None, None),
    ]
    # Every step after the first went live at once, saying where its tokens start.
    assert [(p["token_ids"], p["at"]) for _, [p] in live] == [
        ([t], [t - 1, t - 1]) for t in range(2, 12)
    ]


async def test_a_slow_run_is_stored_once_its_oldest_pending_token_is_old_enough(
    store: EventStore,
) -> None:
    runs = {"a": await started_run(store, "a")}
    appender = StepAppender(
        store, runs, lambda run_id: None, min_interval=0.0, store_tokens=100, store_interval=0.2
    )
    task = asyncio.create_task(appender.run())
    try:
        appender.on_step([out("a", 1)])
        await wait_until(lambda: runs["a"].streamed)
        appender.on_step([out("a", 2)])
        await asyncio.sleep(0.05)
        appender.on_step([out("a", 3)])
        assert runs["a"].last_seq == 3  # neither due: too few tokens, not old enough
        await wait_until(lambda: runs["a"].last_seq == 4, timeout=2.0)
    finally:
        task.cancel()
    *_, last = await store.read("a")
    assert last.payload["token_ids"] == [2, 3]


async def test_tokens_made_while_the_first_are_stored_go_live_once_they_are(
    store: EventStore,
) -> None:
    runs = {"a": await started_run(store, "a")}
    live: list[list[dict[str, object]]] = []
    appender = StepAppender(
        store,
        runs,
        lambda run_id: None,
        publish=lambda run_id, _, pieces: live.append(list(pieces)),
    )
    appender.on_step([out("a", 1)])
    appender.on_step([out("a", 2)])  # before the first tokens are stored: not live yet
    assert live == []
    await appender._append_runs(["a"])  # stores both steps' tokens
    assert live == []
    appender.on_step([out("a", 3)])
    appender.on_step([out("a", 4)])
    assert [p["at"] for [p] in live] == [[2, 2], [3, 3]]
