"""How runs reach the queue: the `runs` projection, and Kafka as a fast trigger.

The projection is the source of truth: every `rescan` seconds (and at start)
every run in state `queued` the scheduler does not know yet is loaded and
queued, and queued runs that left that state elsewhere (a cancel through
admission) are dropped.  Admission's hints (the run as it was stored) and
Kafka `queued` events only make intake immediate; Kafka terminal events end
assignments early.  Nothing depends on the hints or on Kafka keeping its data.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection

import structlog

from services.core.config import RUN_EVENTS_TOPIC, consumer_group
from services.core.idle import IdleFetch
from services.core.kafka_consumer import EventConsumer
from services.core.runs import ENDED_STATES, RunState, StoredEvent, is_ended
from services.scheduler.records import QueuedRun
from services.scheduler.scheduler_store import SchedulerStore
from services.scheduler.state import SchedulerState

log = structlog.get_logger(__name__)

GROUP_ID = "tollgate-scheduler"


class Intake:
    def __init__(self, state: SchedulerState, scheduler_store: SchedulerStore) -> None:
        self.state = state
        self.scheduler_store = scheduler_store

    def take_hinted(self, runs: Collection[QueuedRun]) -> int:
        """Queues the runs admission describes in full, those not known yet."""
        return sum(self.state.enqueue(run) for run in runs if not self.state.knows(run.run_id))

    async def take(self, run_ids: Collection[str]) -> int:
        """Queues those of `run_ids` that are in state `queued` and not known yet, and
        those their worker handed back: assigned, but `queued` again since their lease."""
        wanted = [
            run_id
            for run_id in dict.fromkeys(run_ids)
            if not self.state.knows(run_id) or self.state.is_assigned(run_id)
        ]
        runs = await self.scheduler_store.load_queued(wanted)
        for run in runs:
            self.state.take_back(run)
        return sum(self.state.enqueue(run) for run in runs)

    async def take_events(self, events: Collection[StoredEvent]) -> int:
        """`take` for the runs of `queued` events that may bring a run to the queue: one
        not known here, or one assigned at an earlier seq (handed back). A run's first
        `queued` event, which admission's hint brought already, costs no query."""
        return await self.take([event.run_id for event in events if self._may_queue(event)])

    def _may_queue(self, event: StoredEvent) -> bool:
        if not self.state.knows(event.run_id):
            return True
        assignment = self.state.assignments.get(event.run_id)
        return assignment is not None and event.seq > assignment.last_seq

    async def scan(self) -> int:
        """Brings the queue in line with the projection; returns how many runs were added."""
        queued_before = set(self.state.queued)
        queued_now = set(await self.scheduler_store.queued_run_ids())
        for run_id in queued_before - queued_now:
            # Ended elsewhere meanwhile; a run that left the queue since is untouched.
            if run_id in self.state.queued:
                self.state.dequeue(run_id)
        return await self.take(queued_now)


class EventTrigger:
    """Reads run events from Kafka: `queued` → intake, terminal → assignment ends."""

    def __init__(
        self,
        bootstrap: str,
        *,
        on_queued: Callable[[list[StoredEvent]], Awaitable[object]],
        on_ended: Callable[[str], None],
        topic: str = RUN_EVENTS_TOPIC,
        session_timeout_ms: int = 10_000,
        retry_interval: float = 2.0,
        idle: IdleFetch | None = None,
    ) -> None:
        self.bootstrap = bootstrap
        # Pauses the consumer while no run event comes (services/core/idle.py).
        self.idle = idle
        self.on_queued = on_queued
        self.on_ended = on_ended
        self.topic = topic
        self.group_id = consumer_group(GROUP_ID, topic)
        self.session_timeout_ms = session_timeout_ms
        self.retry_interval = retry_interval
        # Set while the consumer holds partitions, i.e. sees new events.
        self.ready = asyncio.Event()

    async def run(self) -> None:
        """Consumes until cancelled; a broker outage only delays intake to the next scan."""
        while True:
            try:
                await self._consume()
            except Exception as exc:
                log.warning("event trigger stopped", error=repr(exc))
                self.ready.clear()
                await asyncio.sleep(self.retry_interval)

    async def _consume(self) -> None:
        consumer = EventConsumer(
            self.bootstrap,
            self.topic,
            group_id=self.group_id,
            kinds={RunState.QUEUED, *ENDED_STATES},
            # The projection scan covers anything older than this consumer.
            auto_offset_reset="latest",
            auto_commit=True,
            session_timeout_ms=self.session_timeout_ms,
            # Admission's hint brings new runs at once, and a worker's heartbeat its free
            # blocks; this trigger is for the runs whose hint was lost and for ending
            # assignments. Brokers that answer an empty fetch only when this wait is over
            # (the embedded one) are asked twice a second, not 50 times: each empty round
            # costs the scheduler and the broker CPU (bench/RESULTS.md); none is asked
            # while the store is quiet (`idle`).
            fetch_max_wait_ms=500,
            assigned=self.ready,
        )
        try:
            async with consumer:
                async for events in consumer.batches():
                    await self._apply(events)
                    if self.idle is not None:
                        await self.idle.after_poll(consumer)
        finally:
            if self.idle is not None:
                await self.idle.aclose()

    async def _apply(self, events: list[StoredEvent]) -> None:
        queued: list[StoredEvent] = []
        for event in events:
            if event.kind == RunState.QUEUED:
                queued.append(event)
            elif is_ended(event.kind):
                self.on_ended(event.run_id)
        if queued:
            await self.on_queued(queued)
