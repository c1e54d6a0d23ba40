"""Event pipeline throughput and latency: append → relay → Kafka → tracking consumer.

    python -m bench.events [--events N] [--writers W] [--batch B]

Starts its own PostgreSQL and broker (or uses TOLLGATE_DATABASE_URL /
TOLLGATE_KAFKA_BOOTSTRAP), then runs three phases over fresh runs: W writers
appending one event at a time, W writers appending B at a time, and one paced
writer (an append every 20 ms) whose latency is the pipeline's own, free of
queueing.  Each reports events/s end to end (first append to last event applied
by the consumer) and the latency from the append's commit to the consumer
applying it.  Everything runs in this one process, as in a service that
appends, relays and consumes.  The last line is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.ext.asyncio import AsyncConnection

from bench.report import logs_to_stderr, percentile, progress
from services.core.consumer import TrackingConsumer
from services.core.db import Database, open_db
from services.core.event_store import EventStore
from services.core.kafka import create_topic
from services.core.relay import OutboxRelay
from services.core.runs import NewEvent, NewRun, RunState, StoredEvent
from services.stack.infra import LocalInfra


@dataclass(frozen=True, slots=True)
class PhaseResult:
    name: str
    events: int
    seconds: float
    latencies_ms: list[float]

    @property
    def events_per_second(self) -> float:
        return self.events / self.seconds


DRAIN_TIMEOUT_S = 300.0


async def write_runs(
    store: EventStore, runs: int, per_run: int, batch: int, committed: dict, pace: float = 0.0
) -> None:  # type: ignore[type-arg]
    """One writer: `runs` runs of `per_run` events, `batch` per append, `pace` s apart."""
    for _ in range(runs):
        run_id = str(uuid.uuid4())
        seq = 0
        while seq < per_run:
            size = min(batch, per_run - seq)
            events = [_event(seq + i) for i in range(size)]
            new_run = NewRun("bench", "tiny") if seq == 0 else None
            await store.append(run_id, seq, events, new_run=new_run)
            now = time.perf_counter()
            for i in range(size):
                committed[(run_id, seq + i + 1)] = now
            seq += size
            if pace:
                await asyncio.sleep(pace)


def _event(index: int) -> NewEvent:
    if index == 0:
        return NewEvent(RunState.QUEUED, {"model": "tiny"})
    if index == 1:
        return NewEvent(RunState.PREFILL)
    return NewEvent(RunState.STREAMING, {"token_ids": [index], "text": "x"})


async def run_phase(
    db: Database,
    bootstrap: str,
    name: str,
    *,
    events: int,
    writers: int,
    batch: int,
    pace: float = 0.0,
) -> PhaseResult:
    topic = f"bench-{name}-{uuid.uuid4().hex[:8]}"
    await create_topic(bootstrap, topic, 8)
    committed: dict[tuple[str, int], float] = {}
    applied: dict[tuple[str, int], float] = {}

    async def handler(_: AsyncConnection, event: StoredEvent) -> None:
        applied[(event.run_id, event.seq)] = time.perf_counter()

    relay = OutboxRelay(db, bootstrap, topic=topic)
    consumer = TrackingConsumer(db, bootstrap, group_id=topic, handler=handler, topic=topic)
    tasks = [asyncio.create_task(relay.run()), asyncio.create_task(consumer.run())]
    await relay.is_leader.wait()
    await consumer.started.wait()
    await asyncio.sleep(1.0)  # let the consumer group settle before timing
    per_run = 32
    runs_per_writer = max(1, events // (per_run * writers))
    total = runs_per_writer * per_run * writers
    store = EventStore(db)
    started = time.perf_counter()
    await asyncio.gather(
        *(
            write_runs(store, runs_per_writer, per_run, batch, committed, pace)
            for _ in range(writers)
        )
    )
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while len(applied) < total:
        if time.monotonic() > deadline:
            raise SystemExit(f"phase {name}: only {len(applied)} of {total} events consumed")
        await asyncio.sleep(0.01)
    seconds = max(applied.values()) - started
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    latencies = [(applied[key] - committed[key]) * 1000 for key in committed]
    return PhaseResult(name, total, seconds, latencies)


async def bench(args: argparse.Namespace, database_url: str, bootstrap: str) -> list[PhaseResult]:
    db = open_db(database_url, pool_size=args.writers + 4)
    try:
        results = []
        phases = [
            ("single", args.events, args.writers, 1, 0.0),
            ("batched", args.events, args.writers, args.batch, 0.0),
            # One writer well below capacity: the pipeline's own latency, without queueing.
            ("paced", min(args.events, 512), 1, 1, 0.02),
        ]
        for name, events, writers, batch, pace in phases:
            progress(f"phase {name}: {events} events, {writers} writers, batch {batch}")
            result = await run_phase(
                db, bootstrap, name, events=events, writers=writers, batch=batch, pace=pace
            )
            progress(f"phase {name}: {result.events_per_second:,.0f} events/s")
            results.append(result)
        return results
    finally:
        await db.dispose()


def report(results: list[PhaseResult]) -> dict[str, float]:
    print(f"{'appends':<10}{'events':>8}{'events/s':>12}{'p50 ms':>10}{'p99 ms':>10}")
    figures: dict[str, float] = {}
    for r in results:
        p50, p99 = percentile(r.latencies_ms, 50), percentile(r.latencies_ms, 99)
        print(f"{r.name:<10}{r.events:>8}{r.events_per_second:>12,.0f}{p50:>10.1f}{p99:>10.1f}")
        figures[f"{r.name}_events_per_second"] = round(r.events_per_second, 1)
        figures[f"{r.name}_latency_p50_ms"] = round(p50, 2)
        figures[f"{r.name}_latency_p99_ms"] = round(p99, 2)
        figures[f"{r.name}_latency_mean_ms"] = round(statistics.fmean(r.latencies_ms), 2)
    figures["batched_vs_single"] = round(
        results[1].events_per_second / results[0].events_per_second, 2
    )
    figures.pop("paced_events_per_second", None)  # set by the pace, not by the pipeline
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--events", type=int, default=4096, help="events per phase")
    parser.add_argument("--writers", type=int, default=8, help="concurrent appenders")
    parser.add_argument("--batch", type=int, default=16, help="events per append, batched phase")
    args = parser.parse_args()
    logs_to_stderr()
    with tempfile.TemporaryDirectory(prefix="tollgate-bench-") as tmp:
        with LocalInfra(Path(tmp)) as endpoints:
            results = asyncio.run(bench(args, endpoints.database_url, endpoints.kafka_bootstrap))
    print(json.dumps(report(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
