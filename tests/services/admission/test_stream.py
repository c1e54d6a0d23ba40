"""A stream follows commits, survives a lost listener, and falls back to reading the store."""

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator

import pytest
import sqlalchemy as sa

from services.admission.stream import Notice, RunFeed, _offer, stream_events
from services.core.db import EVENTS_CHANNEL, open_db
from services.core.event_store import EventStore
from services.core.live import LIVE_CHANNEL, LivePieces, Position
from services.core.runs import NewEvent, RunState, StoredEvent
from tests.services.admission.worker_double import finish_run
from tests.services.core.events import start_run, streaming

UNTIL_BILLED = frozenset({RunState.BILLED})
# Longer than any test waits: only a wake-up can deliver in time.
NO_POLLING = 600.0


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[EventStore]:
    db = open_db(database_url)
    yield EventStore(db)
    await db.dispose()


@contextlib.asynccontextmanager
async def listening(feed: RunFeed) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(feed.run())
    try:
        await asyncio.wait_for(feed.listening.wait(), 20)
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def collect(store: EventStore, feed: RunFeed, run_id: str, poll_interval: float) -> list[int]:
    events = stream_events(
        store,
        feed,
        run_id,
        Position(0),
        UNTIL_BILLED,
        poll_interval=poll_interval,
        max_poll_interval=poll_interval,
    )
    return [event.seq async for event in events]


@pytest.mark.parametrize(
    "texts",
    [["t"] * 10, ["a", "b" * 10_000, "c"]],
    ids=["from the notices", "one too large for a notice, from the store"],
)
async def test_commits_reach_the_stream(
    store: EventStore, database_url: str, texts: list[str]
) -> None:
    feed = RunFeed(database_url)
    run_id = await start_run(store)
    async with listening(feed):
        reader = asyncio.create_task(collect(store, feed, run_id, NO_POLLING))
        await asyncio.sleep(0.2)  # the reader has sent `queued` and waits
        await finish_run(store, run_id, list(range(len(texts))), texts)
        assert await asyncio.wait_for(reader, 10) == list(range(1, len(texts) + 5))


async def test_events_the_caller_holds_go_first_and_the_rest_come_from_notices(
    store: EventStore, database_url: str
) -> None:
    feed = RunFeed(database_url)
    run_id = await start_run(store)
    [queued] = await store.read(run_id)
    held = dataclasses.replace(queued, payload={**queued.payload, "model": "as held"})
    async with listening(feed):
        reader = asyncio.create_task(follow_holding(store, feed, run_id, held))
        await asyncio.sleep(0.2)
        await finish_run(store, run_id, [7, 8], ["a", "b"])
        events = await asyncio.wait_for(reader, 10)
    assert [event.seq for event in events] == [1, 2, 3, 4, 5, 6]
    # The first event is the caller's copy: the store was not read for it.
    assert events[0].payload["model"] == "as held"


async def test_a_notice_missed_before_subscribing_is_read_from_the_store(
    store: EventStore, database_url: str
) -> None:
    feed = RunFeed(database_url)
    run_id = await start_run(store)
    [queued] = await store.read(run_id)
    async with listening(feed):
        await store.append(run_id, 1, [NewEvent(RunState.PREFILL)])  # no one follows yet
        await asyncio.sleep(0.2)
        reader = asyncio.create_task(follow_holding(store, feed, run_id, queued))
        await asyncio.sleep(0.2)
        # The next notice is for seq 3: the gap sends the stream to the store for seq 2.
        await store.append(run_id, 2, [streaming(7)])
        await store.append(run_id, 3, [NewEvent(RunState.FAILED, {"code": "X", "usage": {}})])
        await store.append(run_id, 4, [NewEvent(RunState.BILLED, {"amount_micros": 0})])
        events = await asyncio.wait_for(reader, 10)
    assert [event.seq for event in events] == [1, 2, 3, 4, 5]


async def follow_holding(
    store: EventStore, feed: RunFeed, run_id: str, queued: StoredEvent
) -> list[StoredEvent]:
    """The run's stream for a caller that holds its `queued` event; notices only."""
    events = stream_events(
        store, feed, run_id, Position(0), UNTIL_BILLED, known=[queued], poll_interval=NO_POLLING
    )
    return [event async for event in events]


async def test_an_unreadable_notice_sends_the_stream_to_the_store(
    store: EventStore, database_url: str
) -> None:
    feed = RunFeed(database_url)
    run_id = await start_run(store)
    async with listening(feed) as task:
        reader = asyncio.create_task(collect(store, feed, run_id, NO_POLLING))
        await asyncio.sleep(0.2)
        async with store.db.connect() as conn:  # as from a version with a new kind
            await conn.execute(
                sa.text("SELECT pg_notify(:channel, :notice)"),
                {"channel": EVENTS_CHANNEL, "notice": f'{run_id} {{"events": [{{"kind": "x"}}]}}'},
            )
            await conn.commit()
        await asyncio.sleep(0.2)
        await finish_run(store, run_id, [1], ["a"])  # delivered only if the feed lives on
        assert await asyncio.wait_for(reader, 10) == list(range(1, 6))
        await asyncio.sleep(0.2)
        assert not task.done() and feed.listening.is_set()


async def test_without_a_listener_the_store_is_polled(store: EventStore, database_url: str) -> None:
    feed = RunFeed(database_url)  # never started
    run_id = await start_run(store)
    reader = asyncio.create_task(collect(store, feed, run_id, 0.05))
    await finish_run(store, run_id, [1, 2, 3], ["a", "b", "c"])
    assert await asyncio.wait_for(reader, 10) == list(range(1, 8))


async def test_events_committed_while_the_listener_was_down_arrive(
    store: EventStore, database_url: str
) -> None:
    # Reconnects long after the events commit: only the wake-up on reconnect brings them.
    feed = RunFeed(database_url, retry_interval=3.0)
    run_id = await start_run(store)
    async with listening(feed):
        reader = asyncio.create_task(collect(store, feed, run_id, NO_POLLING))
        await asyncio.sleep(0.2)
        await end_listener(store)
        while feed.listening.is_set():
            await asyncio.sleep(0.01)
        # Committed while nobody listens: its notification is lost.
        await finish_run(store, run_id, [1, 2], ["a", "b"])
        assert await asyncio.wait_for(reader, 10) == list(range(1, 7))
        assert feed.listening.is_set()


async def test_a_feed_that_stops_listening_sends_its_streams_back_to_polling(
    store: EventStore, database_url: str
) -> None:
    # Reconnects long after the events commit; its streams wait on notices alone until
    # the feed stops listening, then poll every 0.2 s.
    feed = RunFeed(database_url, retry_interval=30.0)
    run_id = await start_run(store)
    async with listening(feed):
        events = stream_events(
            store,
            feed,
            run_id,
            Position(0),
            UNTIL_BILLED,
            poll_interval=5.0,
            max_poll_interval=0.2,
            max_listening_poll_interval=NO_POLLING,
        )
        reader = asyncio.create_task(seqs_of(events))
        await asyncio.sleep(0.3)
        await end_listener(store)
        while feed.listening.is_set():
            await asyncio.sleep(0.01)
        # Committed while nobody listens, in one transaction: only polling brings it.
        rest = [NewEvent(RunState.PREFILL), streaming(1)]
        rest += [NewEvent(RunState.FAILED, {"code": "X", "usage": {}})]
        await store.append(run_id, 1, [*rest, NewEvent(RunState.BILLED, {"amount_micros": 0})])
        assert await asyncio.wait_for(reader, 3) == list(range(1, 6))


async def seqs_of(events: AsyncIterator[StoredEvent]) -> list[int]:
    return [event.seq async for event in events]


async def end_listener(store: EventStore) -> None:
    async with store.db.connect() as conn:
        ended = await conn.scalar(
            sa.text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE query = :listen AND datname = current_database()"
            ),
            {"listen": f"LISTEN {LIVE_CHANNEL}"},  # the feed's last statement
        )
    assert ended == 1


async def test_a_stream_of_an_ended_run_stops_at_its_last_event(
    store: EventStore, database_url: str
) -> None:
    feed = RunFeed(database_url)
    run_id = await start_run(store)
    await finish_run(store, run_id, [1], ["a"])
    events = stream_events(store, feed, run_id, Position(5), UNTIL_BILLED, poll_interval=NO_POLLING)
    assert [e.seq async for e in events] == []
    stored = await store.read(run_id)
    assert stored[-1].kind == RunState.BILLED and stored[-1].seq == 5


async def test_a_subscriber_that_falls_behind_holds_a_bounded_queue(
    store: EventStore, database_url: str
) -> None:
    feed = RunFeed(database_url, max_pending=3)
    run_id = await start_run(store)
    async with listening(feed):
        with feed.subscribe(run_id) as behind, feed.subscribe(run_id) as keeping_up:
            reader = asyncio.create_task(read_until(keeping_up, 11))
            await store.append(run_id, 1, [NewEvent(RunState.PREFILL)])
            for seq in range(2, 11):
                await store.append(run_id, seq, [streaming(seq)])
            # Both queues are handed each notice at once: once the reader has seen the
            # last, the one nobody reads has been offered all ten.
            await asyncio.wait_for(reader, 10)
            pending = [behind.get_nowait() for _ in range(behind.qsize())]
    assert len(pending) <= 3
    assert None in pending  # "read the store", in place of what was dropped


async def test_a_slow_stream_still_gets_every_event_in_order(
    store: EventStore, database_url: str
) -> None:
    feed = RunFeed(database_url, max_pending=2)
    run_id = await start_run(store)
    async with listening(feed):
        events = stream_events(
            store, feed, run_id, Position(0), UNTIL_BILLED, poll_interval=NO_POLLING
        )
        assert (await anext(events)).seq == 1
        await finish_run(store, run_id, list(range(30)), ["t"] * 30)  # read nothing meanwhile
        await asyncio.sleep(0.5)
        rest = [event.seq async for event in events]
    assert rest == list(range(2, 30 + 5))  # prefill, 30 streaming, completed, billed


async def read_until(notices: asyncio.Queue[list[StoredEvent] | None], seq: int) -> None:
    seen = 0
    while seen < seq:
        notice = await notices.get()
        seen = notice[-1].seq if notice else seen


def test_a_full_queue_lets_live_pieces_go_and_keeps_the_stored_notices() -> None:
    queue: asyncio.Queue[Notice] = asyncio.Queue(2)
    stored: Notice = []
    _offer(queue, stored)
    _offer(queue, LivePieces("r", "t", []))
    _offer(queue, LivePieces("r", "t", []))  # full: let go
    assert queue.qsize() == 2 and queue.get_nowait() is stored
    _offer(queue, stored)
    _offer(queue, stored)  # full: the stream goes to the store instead
    assert queue.qsize() == 1 and queue.get_nowait() is None
