import asyncio

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from services.core.db import EVENTS_CHANNEL, Database, libpq_url
from services.core.event_store import (
    Append,
    ConcurrencyConflict,
    EventStore,
    IdempotencyKeyTaken,
    RunNotFound,
    StaleLease,
    append_in,
    parse_notice,
    view_from_row,
)
from services.core.runs import IllegalTransition, NewEvent, NewRun, RunState, RunView
from tests.services.core.events import new_run_id, seqs, start_run, streaming

S = RunState


async def count_rows(db: Database, table: str, run_id: str) -> int:
    async with db.connect() as conn:
        query = sa.text(f"SELECT count(*) FROM {table} WHERE run_id = :r")
        return int(await conn.scalar(query, {"r": run_id}) or 0)


async def test_append_and_read_back(store: EventStore) -> None:
    run_id = await start_run(store)
    await store.append(run_id, 1, [NewEvent(S.PREFILL), streaming(5, 6)])
    events = await store.read(run_id)
    assert seqs(events) == [1, 2, 3]
    assert [e.kind for e in events] == [S.QUEUED, S.PREFILL, S.STREAMING]
    assert events[2].payload == {"token_ids": [5, 6], "text": "xx"}
    assert seqs(await store.read(run_id, after_seq=2)) == [3]
    run = await store.get_run(run_id)
    assert run is not None and run.state == S.STREAMING and run.last_seq == 3


async def test_fifty_concurrent_appenders_exactly_one_wins(store: EventStore) -> None:
    run_id = await start_run(store)
    await store.append(run_id, 1, [NewEvent(S.PREFILL)])

    async def attempt(i: int) -> bool:
        try:
            await store.append(run_id, 2, [streaming(i)])
        except ConcurrencyConflict:
            return False
        return True

    results = await asyncio.gather(*(attempt(i) for i in range(50)))
    assert sum(results) == 1
    # Everyone retries from the true head: the stream stays gapless.
    for i in range(10):
        head = (await store.get_run(run_id)).last_seq  # type: ignore[union-attr]
        await store.append(run_id, head, [streaming(100 + i)])
    assert seqs(await store.read(run_id)) == list(range(1, 14))


async def test_concurrent_first_appends_of_one_run(store: EventStore) -> None:
    run_id = new_run_id()
    results = await asyncio.gather(
        *(start_run(store, run_id) for _ in range(20)), return_exceptions=True
    )
    assert sum(1 for r in results if r == run_id) == 1
    assert all(isinstance(r, ConcurrencyConflict) for r in results if r != run_id)
    assert seqs(await store.read(run_id)) == [1]


@pytest.mark.parametrize(
    ("history", "illegal"),
    [
        ([S.PREFILL, S.STREAMING, S.COMPLETED], S.STREAMING),
        ([S.PREFILL, S.STREAMING, S.COMPLETED], S.FAILED),
        ([S.CANCELLED], S.CANCELLED),
        ([S.CANCELLED, S.BILLED], S.BILLED),
        ([S.CANCELLED, S.BILLED], S.STREAMING),
        ([S.PREFILL, S.STREAMING], S.BILLED),
    ],
    ids=[
        "streaming-after-completed",
        "second-terminal",
        "second-cancelled",
        "second-billed",
        "anything-after-billed",
        "billed-before-terminal",
    ],
)
async def test_illegal_transition_raises_and_writes_nothing(
    store: EventStore, db: Database, history: list[RunState], illegal: RunState
) -> None:
    run_id = await start_run(store)
    await store.append(run_id, 1, [NewEvent(kind) for kind in history])
    before = await store.get_run(run_id)
    with pytest.raises(IllegalTransition):
        await store.append(run_id, before.last_seq, [NewEvent(illegal)])  # type: ignore[union-attr]
    assert await store.get_run(run_id) == before
    assert await count_rows(db, "run_events", run_id) == before.last_seq  # type: ignore[union-attr]


async def test_illegal_event_in_a_batch_rejects_the_whole_batch(store: EventStore) -> None:
    run_id = await start_run(store)
    with pytest.raises(IllegalTransition):
        await store.append(run_id, 1, [NewEvent(S.PREFILL), NewEvent(S.BILLED)])
    assert seqs(await store.read(run_id)) == [1]


async def test_stale_lease_epoch_is_rejected(store: EventStore) -> None:
    run_id = await start_run(store)
    old = await store.acquire_lease(run_id, "worker-a")
    new = await store.acquire_lease(run_id, "worker-b")
    assert new == old + 1
    with pytest.raises(StaleLease):
        await store.append(run_id, 1, [NewEvent(S.PREFILL)], lease_epoch=old)
    await store.append(run_id, 1, [NewEvent(S.PREFILL)], lease_epoch=new)
    run = await store.get_run(run_id)
    assert run is not None and run.owner == "worker-b" and run.last_seq == 2


async def test_an_append_to_a_row_the_caller_locked_is_checked_against_that_row(
    store: EventStore, db: Database
) -> None:
    run_id = await start_run(store)
    async with db.begin() as conn:
        locked = await store_row_locked(conn, run_id)
        with pytest.raises(ConcurrencyConflict):
            await append_in(conn, Append(run_id, 2, [NewEvent(S.PREFILL)], locked=locked))
    async with db.begin() as conn:
        locked = await store_row_locked(conn, run_id)
        [prefill] = await append_in(conn, Append(run_id, 1, [NewEvent(S.PREFILL)], locked=locked))
    assert prefill.seq == 2
    run = await store.get_run(run_id)
    assert run is not None and run.state == S.PREFILL and run.last_seq == 2


async def store_row_locked(conn: AsyncConnection, run_id: str) -> RunView:
    row = (
        await conn.execute(
            sa.text("SELECT * FROM runs WHERE run_id = :r FOR UPDATE"), {"r": run_id}
        )
    ).one()
    return view_from_row(row._mapping)


async def test_append_batch_is_all_or_nothing(store: EventStore) -> None:
    a, b = await start_run(store), await start_run(store)
    with pytest.raises(ConcurrencyConflict):
        await store.append_batch(
            [Append(a, 1, [NewEvent(S.PREFILL)]), Append(b, 7, [NewEvent(S.PREFILL)])]
        )
    assert seqs(await store.read(a)) == [1]
    stored = await store.append_batch(
        [Append(a, 1, [NewEvent(S.PREFILL)]), Append(b, 1, [NewEvent(S.PREFILL)])]
    )
    assert [(e.run_id, e.seq) for e in stored] == [(a, 2), (b, 2)]


async def test_a_batch_over_many_runs_writes_each_run_and_notices_each(
    store: EventStore, database_url: str
) -> None:
    runs = [await start_run(store, tenant_id=f"t{i % 3}") for i in range(12)]
    for run_id in runs:
        await store.append(run_id, 1, [NewEvent(S.PREFILL)])
    usage = {"prompt_tokens": 3, "output_tokens": 2}
    appends = [
        Append(run_id, 2, [streaming(i), streaming(i, i)], traceparent=f"tp{i}")
        if i % 2
        else Append(run_id, 2, [streaming(i), NewEvent(S.COMPLETED, {"usage": usage})])
        for i, run_id in enumerate(runs)
    ]
    new_run = new_run_id()
    queued = Append(new_run, 0, [NewEvent(S.QUEUED)], new_run=NewRun("t9", "tiny"))
    async with await psycopg.AsyncConnection.connect(
        libpq_url(database_url), autocommit=True
    ) as listener:
        await listener.execute(f"LISTEN {EVENTS_CHANNEL}")
        stored = await store.append_batch([*appends, queued])
        notices = [n.payload async for n in listener.notifies(timeout=5, stop_after=13)]
    assert [(e.run_id, e.seq) for e in stored] == [
        *((run_id, seq) for run_id in runs for seq in (3, 4)),
        (new_run, 1),
    ]
    for i, run_id in enumerate(runs):
        view = await store.get_run(run_id)
        assert view is not None and view.last_seq == 4 and view.tenant_id == f"t{i % 3}"
        assert view.state == (S.STREAMING if i % 2 else S.COMPLETED)
        assert view.usage == ({} if i % 2 else usage)
        assert (await store.read(run_id))[2:] == [e for e in stored if e.run_id == run_id]
    by_run = dict(parse_notice(notice) for notice in notices)
    assert set(by_run) == {*runs, new_run}
    for run_id, events in by_run.items():
        assert events == [e for e in stored if e.run_id == run_id]


async def test_batches_over_the_same_runs_in_opposite_orders_do_not_deadlock(
    store: EventStore,
) -> None:
    async def batch(order: list[str]) -> str:
        try:
            await store.append_batch([Append(run_id, 1, [NewEvent(S.PREFILL)]) for run_id in order])
        except ConcurrencyConflict:
            return "conflict"
        return "appended"

    for _ in range(10):
        a, b = await start_run(store), await start_run(store)
        outcomes = await asyncio.gather(batch([a, b]), batch([b, a]))
        assert sorted(outcomes) == ["appended", "conflict"]


async def test_idempotency_key_names_one_run(store: EventStore) -> None:
    first, second = new_run_id(), new_run_id()
    queued = [NewEvent(S.QUEUED)]
    await store.append(first, 0, queued, new_run=NewRun("t1", "tiny", idempotency_key="k"))
    with pytest.raises(IdempotencyKeyTaken) as caught:
        await store.append(second, 0, queued, new_run=NewRun("t1", "tiny", idempotency_key="k"))
    assert caught.value.existing_run_id == first
    # Keys are per tenant.
    await store.append(second, 0, queued, new_run=NewRun("t2", "tiny", idempotency_key="k"))


async def test_unknown_run(store: EventStore) -> None:
    with pytest.raises(RunNotFound):
        await store.append("nope", 1, [NewEvent(S.PREFILL)])
    with pytest.raises(RunNotFound):
        await store.acquire_lease("nope", "w")


async def test_text_with_nul_characters_round_trips(store: EventStore) -> None:
    run_id = await start_run(store)
    text = "a\x00b\ufffd\U0001f600"
    await store.append(
        run_id, 1, [NewEvent(S.PREFILL), NewEvent(S.STREAMING, {"token_ids": [0], "text": text})]
    )
    assert (await store.read(run_id, after_seq=2))[0].payload["text"] == text


async def test_the_notice_carries_the_events_as_stored(
    store: EventStore, database_url: str
) -> None:
    async with await psycopg.AsyncConnection.connect(
        libpq_url(database_url), autocommit=True
    ) as listener:
        await listener.execute(f"LISTEN {EVENTS_CHANNEL}")
        run_id = await start_run(store)
        await store.append(run_id, 1, [NewEvent(RunState.PREFILL), streaming(7, 8)])
        await store.append(
            run_id, 3, [streaming(9), NewEvent(RunState.STREAMING, {"text": "x" * 9000})]
        )
        notices = [n.payload async for n in listener.notifies(timeout=5, stop_after=3)]
    parsed = [parse_notice(notice) for notice in notices]
    assert [run for run, _ in parsed] == [run_id] * 3
    assert [[e.seq for e in events or ()] for _, events in parsed] == [[1], [2, 3], []]
    assert parsed[2][1] is None  # too large to carry: the run id alone
    first, second = parsed[0][1], parsed[1][1]
    assert first is not None and second is not None
    stored = await store.read(run_id)
    assert [*first, *second] == stored[:3]
