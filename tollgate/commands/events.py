"""`tollgate events tail`: an audit consumer of the run-event topic.

It reads Kafka directly (no consumer group, nothing committed), decodes each
record as a `tollgate.v1.RunEvent`, and prints each (run_id, seq) once: delivery
is at least once, so duplicates are expected and dropped here.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from google.protobuf.message import DecodeError

from tollgate.commands.connection import connection_flags, reports_errors, resolve
from tollgate.commands.output import event_dict, event_line, json_line
from tollgate.convert import event_of
from tollgate.types import RunEvent
from tollgate.v1 import events_pb2

if TYPE_CHECKING:
    from aiokafka import AIOKafkaConsumer

RUN_EVENTS_TOPIC = "tollgate.run-events.v1"
POLL_MS = 200


def register(subparsers: Any) -> None:
    """Adds `events tail` to the `tollgate` command line."""
    events = subparsers.add_parser("events", help="the run-event log on Kafka")
    commands = events.add_subparsers(dest="events_command", metavar="COMMAND", required=True)
    tail = commands.add_parser(
        "tail",
        parents=[connection_flags(request_timeout=False)],
        help="print run events as they are published",
    )
    tail.add_argument("--json", action="store_true", help="one JSON object per event")
    tail.add_argument(
        "--from-beginning", action="store_true", help="start at the oldest retained event"
    )
    tail.add_argument("--topic", default=RUN_EVENTS_TOPIC, help=f"default: {RUN_EVENTS_TOPIC}")
    tail.add_argument("--max-events", type=int, help="stop after N distinct events")
    tail.add_argument("--timeout", type=float, help="stop after S seconds")
    tail.set_defaults(func=tail_command)


@dataclass(frozen=True, slots=True)
class TailOptions:
    bootstrap: str
    topic: str
    from_beginning: bool
    max_events: int | None
    timeout: float | None


class Deduper:
    """Passes each (run_id, seq) once."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, int]] = set()

    def is_new(self, event: RunEvent) -> bool:
        key = (event.run_id, event.seq)
        if key in self._seen:
            return False
        self._seen.add(key)
        return True


@reports_errors
def tail_command(args: argparse.Namespace) -> int:
    connection = resolve(args)
    options = TailOptions(
        bootstrap=connection.require_kafka(),
        topic=args.topic,
        from_beginning=args.from_beginning,
        max_events=args.max_events,
        timeout=args.timeout,
    )
    render = (lambda e: json_line(event_dict(e))) if args.json else event_line

    def emit(event: RunEvent) -> None:
        print(render(event), flush=True)

    asyncio.run(tail(options, emit))
    return 0


async def tail(options: TailOptions, emit: Callable[[RunEvent], None]) -> int:
    """Emits distinct events until max_events or the timeout; returns how many."""
    # Imported here: the other client commands, and `tollgate --help`, need no Kafka client.
    from aiokafka import AIOKafkaConsumer

    deadline = time.monotonic() + options.timeout if options.timeout is not None else None
    consumer = AIOKafkaConsumer(bootstrap_servers=options.bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        if not await _assign(consumer, options, deadline):
            return 0
        return await _consume(consumer, options, deadline, emit)
    finally:
        await consumer.stop()


async def _assign(consumer: AIOKafkaConsumer, options: TailOptions, deadline: float | None) -> bool:
    from aiokafka import TopicPartition

    # The topic may not exist yet: wait for it as long as the caller lets us.
    partitions = consumer.partitions_for_topic(options.topic)
    while not partitions:
        if deadline is not None and time.monotonic() >= deadline:
            return False
        await asyncio.sleep(POLL_MS / 1000)
        await consumer.force_metadata_update()
        partitions = consumer.partitions_for_topic(options.topic)
    assigned = [TopicPartition(options.topic, p) for p in sorted(partitions)]
    consumer.assign(assigned)
    if options.from_beginning:
        await consumer.seek_to_beginning(*assigned)
    else:
        await consumer.seek_to_end(*assigned)
    return True


async def _consume(
    consumer: AIOKafkaConsumer,
    options: TailOptions,
    deadline: float | None,
    emit: Callable[[RunEvent], None],
) -> int:
    deduper = Deduper()
    count = 0
    while options.max_events is None or count < options.max_events:
        if deadline is not None and time.monotonic() >= deadline:
            break
        batch = await consumer.getmany(timeout_ms=POLL_MS)
        for record in (r for records in batch.values() for r in records):
            event = _decode(record.value)
            if event is None or not deduper.is_new(event):
                continue
            emit(event)
            count += 1
            if options.max_events is not None and count >= options.max_events:
                break
    return count


def _decode(value: bytes | None) -> RunEvent | None:
    try:
        return event_of(events_pb2.RunEvent.FromString(value or b""))
    except DecodeError:
        print("warning: skipped a record that is not a RunEvent", file=sys.stderr)
        return None
