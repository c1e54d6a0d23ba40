"""A run's events for a client: catch-up from the event store, then live from Kafka.

The live tail subscribes before the catch-up read, so nothing committed in
between is missed; a live event that is not the next seq (Kafka redelivery,
lag, or a lost record) sends the reader back to the event store, which is the
truth.  With nothing live for a while the store is read again, so a stalled
relay or broker slows a stream down but never stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import AsyncIterator, Collection, Iterator

import structlog
from aiokafka import AIOKafkaConsumer

from services.core.codec import kind_of, to_proto
from services.core.eventstore import EventStore
from services.core.runs import RunState
from tollgate.v1 import events_pb2

log = structlog.get_logger(__name__)


class LiveTail:
    """Fans the run-events topic out to per-run subscribers of this process."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self._subscribers: defaultdict[str, set[asyncio.Queue[events_pb2.RunEvent]]] = defaultdict(
            set
        )
        self.started = asyncio.Event()

    async def run(self) -> None:
        consumer = AIOKafkaConsumer(
            self.topic,
            bootstrap_servers=self.bootstrap,
            group_id=None,
            auto_offset_reset="latest",
            # Short fetch waits keep a live token close to its commit.
            fetch_max_wait_ms=20,
        )
        await consumer.start()
        self.started.set()
        try:
            while True:
                batches = await consumer.getmany(timeout_ms=500)
                for records in batches.values():
                    for record in records:
                        self._deliver(record.key, record.value)
        finally:
            await consumer.stop()

    def _deliver(self, key: bytes | None, value: bytes | None) -> None:
        queues = self._subscribers.get(key.decode()) if key else None
        if not queues or value is None:
            return
        event = events_pb2.RunEvent.FromString(value)
        for queue in queues:
            queue.put_nowait(event)

    @contextlib.contextmanager
    def subscribe(self, run_id: str) -> Iterator[asyncio.Queue[events_pb2.RunEvent]]:
        queue: asyncio.Queue[events_pb2.RunEvent] = asyncio.Queue()
        self._subscribers[run_id].add(queue)
        try:
            yield queue
        finally:
            self._subscribers[run_id].discard(queue)
            if not self._subscribers[run_id]:
                del self._subscribers[run_id]


async def stream_events(
    store: EventStore,
    tail: LiveTail,
    run_id: str,
    after_seq: int,
    stop_kinds: Collection[RunState],
    *,
    poll_interval: float = 0.5,
    max_poll_interval: float = 2.0,
) -> AsyncIterator[events_pb2.RunEvent]:
    """Every event of `run_id` after `after_seq`, in order, until one of `stop_kinds`.

    A run that stays silent (queued behind others, or a stalled relay) is re-read from
    the store after `poll_interval`, then twice as long each time up to
    `max_poll_interval`, so waiting streams cost the database little.
    """
    last = seen = after_seq
    wait = poll_interval
    with tail.subscribe(run_id) as live:
        while True:
            caught_up = await store.read(run_id, after_seq=last)
            for stored in caught_up:
                yield to_proto(stored)
                last = stored.seq
                if stored.kind in stop_kinds:
                    return
            if not caught_up and await _ended_before(store, run_id, last, stop_kinds):
                return
            wait = poll_interval if last != seen else min(2 * wait, max_poll_interval)
            seen = last
            async for event in _live_run(live, last, wait):
                yield event
                last = event.seq
                if kind_of(event) in stop_kinds:
                    return


async def _ended_before(
    store: EventStore, run_id: str, seq: int, stop_kinds: Collection[RunState]
) -> bool:
    """True when the run stopped at or before `seq`: nothing more will come."""
    run = await store.get_run(run_id)
    if run is None or run.last_seq > seq:
        return False
    return run.state == RunState.BILLED or run.state in stop_kinds


async def _live_run(
    live: asyncio.Queue[events_pb2.RunEvent], last: int, poll_interval: float
) -> AsyncIterator[events_pb2.RunEvent]:
    """Live events while they arrive exactly in sequence; returns to re-read the store."""
    while True:
        try:
            event = await asyncio.wait_for(live.get(), poll_interval)
        except TimeoutError:
            return
        if event.seq <= last:
            continue  # already delivered (a duplicate, or covered by the catch-up read)
        if event.seq != last + 1:
            return  # a gap: the store fills it
        yield event
        last = event.seq
