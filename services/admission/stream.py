"""A run's events for a client, as their transactions commit, and its tokens as they
are made.

Every append sends a notice when it commits, carrying its events
(`services.core.event_store.parse_notice`), and a worker publishes each step's
tokens as live pieces (`services.core.live`). `RunFeed` listens and hands the
notices of a run to that run's streams. A stream first reads the store, then
takes events from the notices while each is the next seq; anything else (a
notice without its events, a gap, a reconnected listener, or silence for a
while) sends it back to the store, which is the truth. A lost notice costs
latency, never an event. A stream that asked for live pieces sends each that
continues what it sent, and cuts what it sent off the stored events
(`StreamCursor`).

Each stream's queue of notices is bounded: a stream that falls behind (its client
reads slowly, or its run streams fast) has what it holds replaced by "read the
store", so memory stays bounded and the store hands it everything it missed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Collection, Iterator, Sequence

import structlog
from psycopg.conninfo import make_conninfo

from services.core.db import EVENTS_CHANNEL, KEEPALIVES, Listener, libpq_url
from services.core.event_store import EventStore, parse_notice
from services.core.live import (
    LIVE_CHANNEL,
    LivePieces,
    Position,
    StreamCursor,
    merged,
    parse_live_notice,
)
from services.core.loop import within
from services.core.runs import RunState, StoredEvent

log = structlog.get_logger(__name__)

# What a stream is handed: events from a notice, a run's live pieces, or None for
# "read the store".
Notice = list[StoredEvent] | LivePieces | None
MAX_PENDING_NOTICES = 64


class RunFeed:
    """Hands each committed append's events to the subscribers of its run.

    Its listening connection has TCP keepalives (`KEEPALIVES`): gone half-open, it would
    otherwise wait forever, and the streams would fall back to polling."""

    def __init__(
        self,
        database_url: str,
        *,
        retry_interval: float = 1.0,
        max_pending: int = MAX_PENDING_NOTICES,
    ) -> None:
        self.conninfo = make_conninfo(libpq_url(database_url), **KEEPALIVES)
        self.retry_interval = retry_interval
        self.max_pending = max_pending
        self._subscribers: defaultdict[str, set[asyncio.Queue[Notice]]] = defaultdict(set)
        # The subscribers that take live pieces too.
        self._live: defaultdict[str, set[asyncio.Queue[Notice]]] = defaultdict(set)
        self.listening = asyncio.Event()

    async def run(self) -> None:
        """Listens until cancelled, reconnecting after database trouble."""
        while True:
            try:
                async with await Listener.connect(self.conninfo, autocommit=True) as conn:
                    await conn.execute(f"LISTEN {EVENTS_CHANNEL}")
                    await conn.execute(f"LISTEN {LIVE_CHANNEL}")
                    self.listening.set()
                    self._send_all(None)  # whatever committed while nobody listened
                    async for notify in conn.notifies():
                        if notify.channel == LIVE_CHANNEL:
                            self._deliver_live(notify.payload)
                        else:
                            self._deliver(notify.payload)
            except Exception as error:  # the streams poll the store meanwhile
                log.warning("event feed interrupted", error=repr(error))
            self.listening.clear()
            self._send_all(None)  # to the store, and to polling as often as without a feed
            await asyncio.sleep(self.retry_interval)

    def _deliver(self, notice: str) -> None:
        run_id = notice.partition(" ")[0]
        queues = self._subscribers.get(run_id)
        if not queues:
            return  # parsed only for runs someone follows here
        try:
            events = parse_notice(notice)[1]
        except Exception as error:  # e.g. a kind this version does not know: read the store
            log.warning("unreadable event notice", run_id=run_id, error=repr(error))
            events = None
        for queue in queues:
            _offer(queue, events)

    def _deliver_live(self, notice: str) -> None:
        queues = self._live.get(notice.partition(" ")[0])
        if not queues:
            return
        try:
            pieces = parse_live_notice(notice)
        except Exception as error:  # the stored events bring the same tokens
            log.warning("unreadable live notice", error=repr(error))
            return
        for queue in queues:
            _offer(queue, pieces)

    def _send_all(self, notice: Notice) -> None:
        for queues in self._subscribers.values():
            for queue in queues:
                _offer(queue, notice)

    def wake(self, run_id: str) -> None:
        """Sends the run's streams to the store, where each checks whether to stop."""
        for queue in self._subscribers.get(run_id, ()):
            _offer(queue, None)

    @contextlib.contextmanager
    def subscribe(self, run_id: str, *, live: bool = False) -> Iterator[asyncio.Queue[Notice]]:
        """A queue of the run's notices (and its live pieces, with `live`)."""
        queue: asyncio.Queue[Notice] = asyncio.Queue(self.max_pending)
        groups = (self._subscribers, self._live) if live else (self._subscribers,)
        for group in groups:
            group[run_id].add(queue)
        try:
            yield queue
        finally:
            for group in groups:
                group[run_id].discard(queue)
                if not group[run_id]:
                    del group[run_id]


def _offer(queue: asyncio.Queue[Notice], notice: Notice) -> None:
    """Queues `notice`; a full queue is emptied for one None instead, which sends its
    stream to the store for everything the dropped notices held. Live pieces that find
    the queue full are let go alone: the run's next stored event brings their tokens."""
    try:
        queue.put_nowait(notice)
    except asyncio.QueueFull:
        if isinstance(notice, LivePieces):
            return
        while not queue.empty():
            queue.get_nowait()
        queue.put_nowait(None)


async def stream_events(
    store: EventStore,
    feed: RunFeed,
    run_id: str,
    after: Position,
    stop_kinds: Collection[RunState],
    *,
    known: Sequence[StoredEvent] = (),
    stopped: Callable[[], bool] = lambda: False,
    live: bool = False,
    poll_interval: float = 0.5,
    max_poll_interval: float = 2.0,
    max_listening_poll_interval: float = 15.0,
) -> AsyncIterator[StoredEvent]:
    """Every event of `run_id` after `after`, in order, until one of `stop_kinds`; with
    `live`, the run's tokens as they are made too (events with `live` set).

    Subscribed before the first read, so nothing committed in between is missed.
    `known` are the events right after `after` that the caller holds already (the
    `queued` event of a run it has just admitted): they take the first read's place.
    A notice that went by before the subscription shows up as a gap in the next one, or
    as silence, and either sends the stream to the store.
    The stream ends early, before its next read of the store, once `stopped()` is true:
    a `wake` of the run makes it check at once.
    A run that stays silent (queued behind others) is re-read from the store after
    `poll_interval`, then twice as long each time up to `max_poll_interval`, so
    waiting streams cost the database little; up to `max_listening_poll_interval` while
    the feed listens, since every commit then sends a notice and the feed tells its
    streams when it stops listening: what the store is re-read for then is a notice
    lost some other way, and a tenant's hundreds of streams on queued runs would
    otherwise cost everyone's queries.
    """
    cursor = StreamCursor(after)
    seen = after.seq
    wait = poll_interval
    with feed.subscribe(run_id, live=live) as notices:
        while not stopped():
            caught_up = list(known) or await store.read(run_id, after_seq=cursor.seq)
            known = ()
            for stored in caught_up:
                for event in cursor.stored(stored):
                    yield event
                if stored.kind in stop_kinds:
                    return
            if not caught_up and await _ended_before(store, run_id, cursor.seq, stop_kinds):
                return
            longest = max_listening_poll_interval if feed.listening.is_set() else max_poll_interval
            wait = poll_interval if cursor.seq != seen else min(2 * wait, longest)
            seen = cursor.seq
            async for event in _live(notices, cursor, wait):
                yield event
                if event.kind in stop_kinds and not event.live:
                    return


async def _ended_before(
    store: EventStore, run_id: str, seq: int, stop_kinds: Collection[RunState]
) -> bool:
    """True when the run stopped at or before `seq`: nothing more will come."""
    run = await store.get_run(run_id)
    if run is None or run.last_seq > seq:
        return False
    return run.state == RunState.BILLED or run.state in stop_kinds


async def _live(
    notices: asyncio.Queue[Notice], cursor: StreamCursor, timeout: float
) -> AsyncIterator[StoredEvent]:
    """Events from notices while each is the next seq, and live pieces; returns to read
    the store. Live pieces that piled up one after another go out as one event each run
    of them makes (`merged`): a stream that fell behind catches up in fewer sends."""
    while True:
        try:
            notice = await within(notices.get(), timeout)
        except TimeoutError:
            return
        if isinstance(notice, LivePieces):
            pieces, after = _piled_up(notices, notice)
            for event in cursor.live(merged(pieces)):
                yield event
            if after is _NOTHING:
                continue
            notice = after
        if notice is None:
            return
        assert isinstance(notice, list)
        for stored in notice:
            if stored.seq <= cursor.seq:
                continue  # already sent (read from the store meanwhile)
            if stored.seq != cursor.seq + 1:
                return  # a gap: the store fills it
            for event in cursor.stored(stored):
                yield event


# What `_piled_up` found after the live pieces when the queue held nothing else.
_NOTHING: Notice = []


def _piled_up(notices: asyncio.Queue[Notice], first: LivePieces) -> tuple[list[LivePieces], Notice]:
    """`first` and the live pieces queued right behind it; and the notice taken after
    them (`_NOTHING` when none was)."""
    pieces = [first]
    while not notices.empty():
        notice = notices.get_nowait()
        if not isinstance(notice, LivePieces):
            return pieces, notice
        pieces.append(notice)
    return pieces, _NOTHING
