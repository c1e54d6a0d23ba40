"""A run's tokens reach its streams as the worker makes them, each once, and a stream
resumed from anywhere in them goes on without repeating or dropping one: the worker's
appender and live publisher, PostgreSQL's notices, and admission's stream, all real."""

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from engine.outputs import RequestOutput
from services.admission.stream import RunFeed, stream_events
from services.core.db import open_db
from services.core.event_store import EventStore
from services.core.live import Position, event_id, parse_position
from services.core.runs import NewEvent, RunState, StoredEvent
from services.worker.appender import StepAppender
from services.worker.live import LivePublisher
from services.worker.runs import AssignedRun
from tests.services.admission.test_stream import listening
from tests.services.core.events import start_run
from tests.services.worker.test_runs import METRICS

ENDED = frozenset({RunState.COMPLETED})
NUM_TOKENS = 40
# Characters of different widths, one of them wider than a UTF-16 unit.
TEXTS = ["a", "é", "😀", "bc", ""]


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[EventStore]:
    db = open_db(database_url)
    yield EventStore(db)
    await db.dispose()


def text_of(token: int) -> str:
    return TEXTS[token % len(TEXTS)]


def output(run_id: str, token: int) -> RequestOutput:
    last = token == NUM_TOKENS
    return RequestOutput(
        run_id, (token,), text_of(token), last, "length" if last else None, METRICS
    )


@contextlib.asynccontextmanager
async def worker(store: EventStore, database_url: str, run_id: str) -> AsyncIterator[StepAppender]:
    """The worker's side of one leased run: stored every 8 tokens, each step live."""
    epoch = await store.acquire_lease(run_id, "worker-1")
    await store.append(run_id, 1, [NewEvent(RunState.PREFILL)], lease_epoch=epoch)
    run = AssignedRun(run_id=run_id, tenant_id="t1", lease_epoch=epoch, last_seq=2)
    publisher = LivePublisher(database_url)
    appender = StepAppender(
        store, {run_id: run}, lambda _: None, publish=publisher.publish,
        min_interval=0.0, store_tokens=8, store_interval=60.0,
    )  # fmt: skip
    tasks = [asyncio.create_task(appender.run()), asyncio.create_task(publisher.run())]
    while not publisher.connected:
        await asyncio.sleep(0.01)
    try:
        yield appender
    finally:
        for task in tasks:
            task.cancel()


async def produce(appender: StepAppender, run_id: str, tokens: range) -> None:
    for token in tokens:
        appender.on_step([output(run_id, token)])
        await asyncio.sleep(0.005)


def stream(
    store: EventStore, feed: RunFeed, run_id: str, after: Position
) -> AsyncIterator[StoredEvent]:
    return stream_events(store, feed, run_id, after, ENDED, live=True, poll_interval=600.0)


def tokens_of(events: list[StoredEvent]) -> list[int]:
    return [t for e in events if e.kind == RunState.STREAMING for t in e.payload["token_ids"]]


def text(events: list[StoredEvent]) -> str:
    return "".join(e.payload["text"] for e in events if e.kind == RunState.STREAMING)


async def test_each_token_reaches_the_stream_once_mostly_before_it_is_stored(
    store: EventStore, database_url: str
) -> None:
    run_id = await start_run(store)
    feed = RunFeed(database_url)
    async with listening(feed), worker(store, database_url, run_id) as appender:
        events: list[StoredEvent] = []

        async def read() -> None:
            async for event in stream(store, feed, run_id, Position(0)):
                events.append(event)

        reader = asyncio.create_task(read())
        await asyncio.sleep(0.2)
        await produce(appender, run_id, range(1, NUM_TOKENS + 1))
        await asyncio.wait_for(reader, 10)
    assert tokens_of(events) == list(range(1, NUM_TOKENS + 1))
    assert text(events) == "".join(text_of(t) for t in range(1, NUM_TOKENS + 1))
    stored = [e for e in events if not e.live]
    assert [e.seq for e in stored] == list(range(1, stored[-1].seq + 1))  # every seq, in order
    assert len(tokens_of([e for e in events if e.live])) > NUM_TOKENS // 2
    # Stored: queued, prefill, the first token, then one event every 8 tokens, completed.
    assert len(await store.read(run_id)) <= 4 + 1 + NUM_TOKENS // 8 + 1


@pytest.mark.parametrize("cut_after", [1, 5, 9, 23])
async def test_a_stream_resumed_from_a_live_event_goes_on_where_it_stopped(
    store: EventStore, database_url: str, cut_after: int
) -> None:
    run_id = await start_run(store)
    feed = RunFeed(database_url)
    async with listening(feed), worker(store, database_url, run_id) as appender:
        first: list[StoredEvent] = []

        async def read_until_cut() -> None:
            async for event in stream(store, feed, run_id, Position(0)):
                first.append(event)
                if len(tokens_of(first)) >= cut_after and event.live:
                    return  # the client goes away after a live event

        reader = asyncio.create_task(read_until_cut())
        await asyncio.sleep(0.2)
        producer = asyncio.create_task(produce(appender, run_id, range(1, NUM_TOKENS + 1)))
        await asyncio.wait_for(reader, 10)
        position = parse_position(event_id(first[-1]))
        assert position is not None and position.tokens == len(tokens_of(first))
        rest = [e async for e in stream(store, feed, run_id, position)]
        await producer
    assert tokens_of(first) + tokens_of(rest) == list(range(1, NUM_TOKENS + 1))
    assert text(first) + text(rest) == "".join(text_of(t) for t in range(1, NUM_TOKENS + 1))


async def test_a_stream_resumed_after_the_run_ended_gets_only_what_it_lacked(
    store: EventStore, database_url: str
) -> None:
    run_id = await start_run(store)
    feed = RunFeed(database_url)
    async with listening(feed), worker(store, database_url, run_id) as appender:
        await produce(appender, run_id, range(1, NUM_TOKENS + 1))
        await appender.flush()
    events = await store.read(run_id)
    # A client that saw 11 tokens live, after the stored event that held the first.
    first_stored = next(e for e in events if e.kind == RunState.STREAMING)
    position = Position(first_stored.seq, 11, len("".join(text_of(t) for t in range(1, 12))))
    async with listening(feed):
        rest = [e async for e in stream(store, feed, run_id, position)]
    assert tokens_of(rest) == list(range(12, NUM_TOKENS + 1))
    assert text(rest) == "".join(text_of(t) for t in range(12, NUM_TOKENS + 1))
