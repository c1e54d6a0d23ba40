"""Two ledger processes on one database and topic: their consumers share the topic's
partitions, their sweeps race over the same runs, and every run is billed once."""

import asyncio
import os
from contextlib import AsyncExitStack

from services.core.db import Database
from services.core.event_store import EventStore
from services.core.runs import RunState
from tests.services.ledger.runs import entry_count, open_reservations, terminal_run
from tests.services.processes import service_process
from tests.services.scheduler.helpers import wait_for

NUM_RUNS = 24


async def test_two_ledgers_bill_each_run_once(
    database_url: str, kafka_bootstrap: str, kafka_topic: str, store: EventStore, db: Database
) -> None:
    env = {
        **os.environ,
        "TOLLGATE_DATABASE_URL": database_url,
        "TOLLGATE_KAFKA_BOOTSTRAP": kafka_bootstrap,
        "TOLLGATE_TOPIC": kafka_topic,
        "TOLLGATE_LISTEN": "127.0.0.1:0",
        # Both sweeps bill at once what the consumers have not, racing them and each other.
        "TOLLGATE_LEDGER_SWEEP_GRACE": "0",
        "TOLLGATE_LEDGER_SWEEP_INTERVAL": "0.1",
    }
    async with AsyncExitStack() as stack:
        for _ in range(2):
            await stack.enter_async_context(service_process("ledger", env))
        run_ids = []
        for _ in range(NUM_RUNS):
            run_ids.append(await terminal_run(store))
            await asyncio.sleep(0.02)  # spread over the sweeps' rounds

        async def all_billed() -> bool:
            runs = [await store.get_run(r) for r in run_ids]
            return all(r is not None and r.state == RunState.BILLED for r in runs)

        await wait_for(all_billed, timeout=30)
        await asyncio.sleep(1.0)  # time for a second bill, should one be coming

    for run_id in run_ids:
        kinds = [e.kind for e in await store.read(run_id)]
        assert kinds.count(RunState.BILLED) == 1 and kinds[-1] == RunState.BILLED
        assert await entry_count(db, run_id) == 3
    assert await open_reservations(db) == 0
