import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable

import pytest
import sqlalchemy as sa
from prometheus_client import REGISTRY

from services.core.db import Database
from services.core.event_store import Append, EventStore, append_in
from services.core.relay import OutboxRelay
from services.core.runs import NewEvent, NewRun, RunState
from tests.services.core.events import new_run_id, start_run, streaming
from tests.services.core.kafka_tools import read_topic
from tollgate.v1 import events_pb2


@contextlib.asynccontextmanager
async def running(relay: OutboxRelay) -> AsyncIterator[OutboxRelay]:
    task = asyncio.create_task(relay.run())
    try:
        await asyncio.wait_for(relay.is_leader.wait(), 20)
        yield relay
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def num_published() -> float:
    return REGISTRY.get_sample_value("tollgate_relay_events_published_total") or 0.0


async def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def ids_of(records: list) -> list[tuple[str, int]]:  # type: ignore[type-arg]
    decoded = [events_pb2.RunEvent.FromString(r.value) for r in records]
    return [(e.run_id, e.seq) for e in decoded]


async def test_publishes_every_event_in_per_run_order(
    store: EventStore, db: Database, kafka_bootstrap: str, kafka_topic: str
) -> None:
    runs = [await start_run(store) for _ in range(5)]
    for run_id in runs:
        await store.append(run_id, 1, [NewEvent(RunState.PREFILL)])
        for seq in range(2, 8):
            await store.append(run_id, seq, [streaming(seq)])
    before = num_published()
    async with running(OutboxRelay(db, kafka_bootstrap, topic=kafka_topic)):
        records = await read_topic(kafka_bootstrap, kafka_topic, min_records=40)
        # Counted once the batch is marked published, just after the broker's ack.
        await wait_for(lambda: num_published() >= before + 40)
    assert num_published() == before + 40
    published = ids_of(records)
    assert Counter(published) == Counter((r, s) for r in runs for s in range(1, 9))
    for run_id in runs:
        assert [s for r, s in published if r == run_id] == list(range(1, 9))
    assert all(r.key == ids[0].encode() for r, ids in zip(records, published, strict=False))


async def test_notify_wakes_the_relay_without_polling(
    store: EventStore, db: Database, kafka_bootstrap: str, kafka_topic: str
) -> None:
    relay = OutboxRelay(db, kafka_bootstrap, topic=kafka_topic, poll_interval=60)
    async with running(relay):
        await asyncio.sleep(0.3)  # the relay is now parked waiting for a notification
        started = time.monotonic()
        run_id = await start_run(store)
        records = await read_topic(kafka_bootstrap, kafka_topic, min_records=1, timeout=10)
        assert ids_of(records) == [(run_id, 1)]
        # Far below the 60 s poll interval: only the notification can explain it.
        assert time.monotonic() - started < 5


async def outbox_marks(db: Database, run_ids: list[str]) -> dict[tuple[str, int], int | None]:
    """The kafka offset each run event's outbox row is marked with (None: not marked)."""
    async with db.connect() as conn:
        rows = await conn.execute(
            sa.text(
                "SELECT run_id, seq, published_at IS NOT NULL AS marked, kafka_offset"
                " FROM outbox WHERE run_id = ANY(:run_ids)"
            ),
            {"run_ids": run_ids},
        )
        return {(r.run_id, r.seq): r.kafka_offset if r.marked else None for r in rows}


async def test_a_batch_is_marked_by_the_next_fetch_and_when_the_relay_stops(
    store: EventStore, db: Database, kafka_bootstrap: str, kafka_topic: str
) -> None:
    relay = OutboxRelay(db, kafka_bootstrap, topic=kafka_topic, poll_interval=60)
    before = num_published()
    first = await start_run(store)
    async with running(relay):
        await wait_for(lambda: num_published() >= before + 1)
        # Acknowledged; its mark waits for the relay's next statement.
        assert await outbox_marks(db, [first]) == {(first, 1): None}
        second = await start_run(store)
        await wait_for(lambda: num_published() >= before + 2)
        marks = await outbox_marks(db, [first, second])
        assert marks[first, 1] is not None and marks[second, 1] is None
        records = await read_topic(kafka_bootstrap, kafka_topic, min_records=2)
    offsets = {ids: record.offset for ids, record in zip(ids_of(records), records, strict=True)}
    # Stopping wrote the last batch's mark: each row holds where the broker put it.
    assert await outbox_marks(db, [first, second]) == offsets


async def test_late_committing_transaction_is_not_skipped(
    store: EventStore, db: Database, kafka_bootstrap: str, kafka_topic: str
) -> None:
    relay = OutboxRelay(db, kafka_bootstrap, topic=kafka_topic, poll_interval=0.2)
    async with running(relay):
        slow_run, fast_run = new_run_id(), new_run_id()
        queued = [NewEvent(RunState.QUEUED)]
        async with db.begin() as slow:
            # T1 takes the lower outbox id, then stalls before committing.
            await append_in(slow, Append(slow_run, 0, queued, NewRun("t1", "tiny")))
            await store.append(fast_run, 0, queued, new_run=NewRun("t1", "tiny"))
            first = await read_topic(kafka_bootstrap, kafka_topic, min_records=1)
            assert ids_of(first) == [(fast_run, 1)]
            await asyncio.sleep(1.0)  # several relay passes go by meanwhile
        records = await read_topic(kafka_bootstrap, kafka_topic, min_records=2)
    assert sorted(ids_of(records)) == sorted([(fast_run, 1), (slow_run, 1)])


async def test_only_one_relay_leads_and_another_takes_over(
    db: Database, kafka_bootstrap: str, kafka_topic: str
) -> None:
    first = OutboxRelay(db, kafka_bootstrap, topic=kafka_topic, takeover_interval=0.1)
    second = OutboxRelay(db, kafka_bootstrap, topic=kafka_topic, takeover_interval=0.1)
    task_one = asyncio.create_task(first.run())
    await asyncio.wait_for(first.is_leader.wait(), 20)
    task_two = asyncio.create_task(second.run())
    await asyncio.sleep(1.0)
    assert not second.is_leader.is_set()
    task_one.cancel()
    started = time.monotonic()
    await asyncio.wait_for(second.is_leader.wait(), 10)
    assert time.monotonic() - started < 5
    task_two.cancel()
    await asyncio.gather(task_one, task_two, return_exceptions=True)


@pytest.mark.slow
async def test_relay_killed_after_ack_before_mark_is_taken_over(
    store: EventStore,
    db: Database,
    database_url: str,
    kafka_bootstrap: str,
    kafka_topic: str,
) -> None:
    runs = [await start_run(store) for _ in range(3)]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.services.core.relay_proc",
            database_url,
            kafka_bootstrap,
            kafka_topic,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
        if line.startswith("leading"):
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
        assert line.startswith("acked 3"), line
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    for run_id in runs:
        await store.append(run_id, 1, [NewEvent(RunState.PREFILL)])
    async with running(OutboxRelay(db, kafka_bootstrap, topic=kafka_topic)):
        records = await read_topic(kafka_bootstrap, kafka_topic, min_records=9)
    published = Counter(ids_of(records))
    # The killed relay's batch went out twice; everything after it once.
    assert {key: n for key, n in published.items() if key[1] == 1} == {(r, 1): 2 for r in runs}
    assert {key: n for key, n in published.items() if key[1] == 2} == {(r, 2): 1 for r in runs}

    from tests.services.core.test_consumer import applied_effects, consume_all

    await consume_all(db, kafka_bootstrap, kafka_topic, min_events=6)
    assert await applied_effects(db) == {(r, s): 1 for r in runs for s in (1, 2)}


def num_dead_lettered() -> float:
    return REGISTRY.get_sample_value("tollgate_relay_events_dead_lettered_total") or 0.0


async def dead_letters(db: Database) -> list[tuple[str, int, str]]:
    async with db.connect() as conn:
        rows = await conn.execute(
            sa.text("SELECT run_id, seq, error FROM dead_letters ORDER BY id")
        )
        return [(row.run_id, row.seq, row.error) for row in rows]


async def num_unpublished(db: Database) -> int:
    async with db.connect() as conn:
        query = "SELECT count(*) FROM outbox WHERE published_at IS NULL"
        return int((await conn.execute(sa.text(query))).scalar_one())


async def test_an_event_the_producer_or_the_encoder_refuses_is_set_aside_and_the_rest_go_on(
    store: EventStore, db: Database, kafka_bootstrap: str, kafka_topic: str
) -> None:
    too_large, unencodable, healthy = [await start_run(store) for _ in range(3)]
    huge = NewEvent(RunState.STREAMING, {"token_ids": [5], "text": "x" * 1_100_000})
    await store.append(too_large, 1, [NewEvent(RunState.PREFILL), huge])
    await store.append(too_large, 3, [NewEvent(RunState.FAILED, {"code": "ENGINE_ERROR"})])
    garbled = NewEvent(RunState.STREAMING, {"token_ids": ["not a token id"]})
    await store.append(unencodable, 1, [NewEvent(RunState.PREFILL), garbled])
    await store.append(healthy, 1, [NewEvent(RunState.PREFILL)])
    before = num_dead_lettered()

    relay = OutboxRelay(db, kafka_bootstrap, topic=kafka_topic, poll_interval=0.2)
    async with running(relay):
        await wait_for(lambda: num_dead_lettered() == before + 2)
        later = await start_run(store)  # the relay goes on with what comes next
        records = await read_topic(kafka_bootstrap, kafka_topic, min_records=7)

    assert sorted(set(ids_of(records))) == sorted(
        [(too_large, 1), (too_large, 2), (too_large, 4), (unencodable, 1), (unencodable, 2)]
        + [(healthy, 1), (healthy, 2), (later, 1)]
    )
    letters = await dead_letters(db)
    assert [(run_id, seq) for run_id, seq, _ in letters] in (
        [(too_large, 3), (unencodable, 3)],
        [(unencodable, 3), (too_large, 3)],
    )
    assert all(error for _, _, error in letters)
    assert await num_unpublished(db) == 0
