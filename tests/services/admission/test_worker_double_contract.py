"""The worker double's events are those of a run the real worker ran and the real ledger
billed: the same kinds in the same order, with the same payload keys, all accepted by the
event store's state machine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from services.core.db import open_db
from services.core.event_store import EventStore
from services.core.pricing import PriceTable
from services.core.runs import RunState, StoredEvent
from services.ledger.sweep import Sweeper
from tests.services.admission.worker_double import finish_run
from tests.services.scheduler.helpers import queue_run
from tests.services.worker.running import PROMPT, leased_run, running_worker

NUM_TOKENS = 3
PRICES = PriceTable({"*": {"input_tokens": 1, "cached_input_tokens": 0, "output_tokens": 2}})


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[EventStore]:
    db = open_db(database_url)
    yield EventStore(db)
    await db.dispose()


async def real_run(store: EventStore, model_dir: Path) -> list[StoredEvent]:
    """A run through the real worker (WorkerService over WorkerCore) and the real ledger."""
    async with running_worker(store, model_dir) as worker:
        request = await leased_run(store, worker.worker_id, NUM_TOKENS)
        await worker.stub.AssignRun(request)
        async with asyncio.timeout(30):
            while (run := await store.get_run(request.run_id)) and run.state != "completed":
                await asyncio.sleep(0.05)
    assert await Sweeper(store.db, PRICES, grace=0).bill_one(request.run_id) is not None
    return await store.read(request.run_id)


async def double_run(store: EventStore) -> list[StoredEvent]:
    run_id = await queue_run(store, max_tokens=NUM_TOKENS, prompt=PROMPT)
    await finish_run(store, run_id, [5, 6, 7], ["a", "b", "c"])
    return await store.read(run_id)


def assert_a_billed_run(events: Sequence[StoredEvent]) -> None:
    """What every run the worker finished and the ledger billed reads as."""
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    kinds = [e.kind for e in events]
    assert kinds[:2] == [RunState.QUEUED, RunState.PREFILL]
    assert set(kinds[2:-2]) == {RunState.STREAMING}
    assert kinds[-2:] == [RunState.COMPLETED, RunState.BILLED]
    queued, completed, billed = events[0], events[-2], events[-1]
    usage = completed.payload["usage"]
    assert usage["prompt_tokens"] == len(queued.payload["prompt_token_ids"]) == len(PROMPT)
    streamed = [t for e in events if e.kind == RunState.STREAMING for t in e.payload["token_ids"]]
    assert usage["output_tokens"] == len(streamed) == NUM_TOKENS
    entries = billed.payload["entries"]
    assert billed.payload["amount_micros"] == sum(e["amount_micros"] for e in entries)
    assert all(e["run_id"] == queued.run_id for e in entries)


def shape(events: Sequence[StoredEvent]) -> list[tuple[str, Any]]:
    """Kinds in order, consecutive streaming events as one, each with its payload's keys
    (and those of its usage and ledger entries)."""
    found: list[tuple[str, Any]] = []
    for event in events:
        keys = (
            frozenset(event.payload),
            frozenset(event.payload.get("usage", {})),
            frozenset(k for entry in event.payload.get("entries", []) for k in entry),
            frozenset(entry["billing_type"] for entry in event.payload.get("entries", [])),
        )
        if not found or found[-1] != (event.kind, keys):
            found.append((event.kind, keys))
    return found


async def test_the_doubles_run_reads_as_the_real_workers_and_ledgers(
    store: EventStore, tiny_model_dir: Path
) -> None:
    real = await real_run(store, tiny_model_dir)
    double = await double_run(store)
    assert_a_billed_run(real)
    assert_a_billed_run(double)
    assert shape(double) == shape(real)
    run = await store.get_run(double[0].run_id)
    assert run is not None and run.state == RunState.BILLED
    assert run.usage == double[-2].payload["usage"]
