"""Intake from Kafka and fairness across tenants of different weights."""

import json
from collections import Counter

from prometheus_client import REGISTRY

from services.core.config import RUN_EVENTS_TOPIC
from services.core.db import Database
from services.core.event_store import EventStore
from services.core.runs import NewEvent, RunState
from services.scheduler.intake import GROUP_ID, EventTrigger
from tests.services.scheduler.helpers import add_tenant, queue_run, wait_for
from tollgate.v1 import scheduler_pb2


async def _stats(scheduler) -> scheduler_pb2.QueueStats:  # type: ignore[no-untyped-def]
    return await scheduler.stub.GetQueueStats(scheduler_pb2.GetQueueStatsRequest())


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _total(name: str) -> float:
    """The sum of the samples named `name`, whatever their labels."""
    return sum(
        sample.value
        for family in REGISTRY.collect()
        for sample in family.samples
        if sample.name == name
    )


async def test_kafka_events_drive_intake_and_end_assignments_between_rescans(
    store: EventStore, start_scheduler, fake_workers
) -> None:
    worker = await fake_workers("w1", free_blocks=1)
    scheduler = await start_scheduler({"w1": worker.address}, rescan_seconds=60)
    await wait_for(scheduler.app.trigger.ready.is_set)
    await wait_for(scheduler.app.relay.is_leader.is_set)
    dispatched = _sample("tollgate_scheduler_dispatches_total", outcome="assigned")
    waited = _total("tollgate_request_queue_time_seconds_count")

    first = await queue_run(store)
    await wait_for(lambda: worker.assignment(first), timeout=10)
    # Counted once the worker's answer is back, which may be a moment after it has the run.
    await wait_for(
        lambda: (
            _sample("tollgate_scheduler_dispatches_total", outcome="assigned") == dispatched + 1
        ),
        timeout=10,
    )
    assert _total("tollgate_request_queue_time_seconds_count") == waited + 1

    # No room left: the next run waits, until a cancel through admission ends it.
    second = await queue_run(store)
    await wait_for(lambda: _depth_is(scheduler, 1), timeout=10)
    assert _sample("tollgate_scheduler_queue_depth", queue_class="interactive") == 1
    await store.append(second, 1, [NewEvent(RunState.CANCELLED, {"reason": "client"})])
    await wait_for(lambda: _depth_is(scheduler, 0), timeout=10)

    await store.append(first, 1, [NewEvent(RunState.PREFILL, {})])
    await store.append(first, 2, [NewEvent(RunState.FAILED, {"code": "ENGINE"})])
    await wait_for(lambda: _running_is(scheduler, 0), timeout=10)


async def test_a_hint_from_admission_dispatches_a_run_without_kafka(
    store: EventStore, start_scheduler, fake_workers
) -> None:
    worker = await fake_workers("w1")
    before_start = await queue_run(store)
    # No broker at this address and no rescan within the test: after the start-up scan,
    # which dispatches `before_start`, only the hint brings runs in.
    scheduler = await start_scheduler(
        {"w1": worker.address}, rescan_seconds=60, kafka_bootstrap="127.0.0.1:9"
    )
    await wait_for(lambda: worker.assignment(before_start), timeout=10)
    run_id = await queue_run(store)
    hint = scheduler_pb2.RunsQueuedRequest(run_ids=[run_id, "run_unknown"])
    assert (await scheduler.stub.RunsQueued(hint)).num_taken == 1
    await wait_for(lambda: worker.assignment(run_id), timeout=10)
    assert (await scheduler.stub.RunsQueued(hint)).num_taken == 0  # a repeated hint


async def test_a_hinted_run_is_queued_without_reading_it_and_leased_only_as_described(
    store: EventStore, start_scheduler, fake_workers
) -> None:
    worker = await fake_workers("w1")
    scheduler = await start_scheduler(
        {"w1": worker.address}, rescan_seconds=60, kafka_bootstrap="127.0.0.1:9"
    )
    run_id = await queue_run(store)
    [queued] = await store.read(run_id)
    ended = await queue_run(store)
    await store.append(ended, 1, [NewEvent(RunState.CANCELLED, {"reason": "client"})])
    stale = await queue_run(store)

    def hint(run: str, last_seq: int = 1) -> scheduler_pb2.HintedRun:
        described = scheduler_pb2.HintedRun(
            run_id=run,
            tenant_id="t1",
            model="tiny",
            priority="interactive",
            last_seq=last_seq,
            # Unlike the stored payload (max_tokens 13): the scheduler takes the hint's word.
            queued_payload_json=json.dumps({**queued.payload, "sampling": {"max_tokens": 9}}),
            tenant_weight=1,
        )
        described.queued_at.FromDatetime(queued.created_at)
        return described

    request = scheduler_pb2.RunsQueuedRequest(runs=[hint(run_id), hint(ended), hint(stale, 2)])
    assert (await scheduler.stub.RunsQueued(request)).num_taken == 3
    await wait_for(lambda: worker.assignment(run_id), timeout=10)
    assert worker.assignment(run_id).sampling.max_tokens == 9  # type: ignore[union-attr]
    # Taken on the hint's word, but never leased or assigned: one was cancelled, and
    # the other is not at the seq the hint describes.
    await wait_for(lambda: _depth_is(scheduler, 0), timeout=10)
    assert worker.assignment(ended) is None and worker.assignment(stale) is None
    assert (await scheduler.stub.RunsQueued(request)).num_taken == 2  # not `run_id` again


async def _depth_is(scheduler, expected: int) -> bool:  # type: ignore[no-untyped-def]
    return (await _stats(scheduler)).num_interactive == expected


async def _running_is(scheduler, expected: int) -> bool:  # type: ignore[no-untyped-def]
    return (await _stats(scheduler)).num_running == expected


async def test_a_tenant_of_weight_two_gets_twice_the_dispatches(
    db: Database, store: EventStore, start_scheduler, fake_workers
) -> None:
    await add_tenant(db, "heavy", weight=2)
    await add_tenant(db, "light", weight=1)
    worker = await fake_workers("w1", free_blocks=0)
    scheduler = await start_scheduler({"w1": worker.address})
    for _ in range(6):
        await queue_run(store, "heavy")
        await queue_run(store, "light")
    await wait_for(lambda: _depth_is(scheduler, 12))

    worker.free_blocks = 6  # one block per run
    await wait_for(lambda: len(worker.assigned) == 6)
    assert Counter(r.tenant_id for r in worker.assigned) == {"heavy": 4, "light": 2}


def test_the_kafka_trigger_joins_the_group_of_its_topic() -> None:
    async def ignore(run_ids: object) -> None:
        return None

    def trigger(topic: str) -> EventTrigger:
        return EventTrigger("unused:0", on_queued=ignore, on_ended=lambda run_id: None, topic=topic)

    assert trigger(RUN_EVENTS_TOPIC).group_id == GROUP_ID
    assert trigger("stack-b.run-events").group_id == f"{GROUP_ID}.stack-b.run-events"
