"""A relay process that stops dead after the broker acknowledges its first batch.

Run as `python -m tests.services.core.relay_proc DATABASE_URL BOOTSTRAP TOPIC`;
it prints `acked N` once a batch of N events is acknowledged, and then waits
(never marking the batch published) until it is killed.
"""

import asyncio
import sys
from collections.abc import Sequence

import psycopg

from services.core.db import open_db
from services.core.relay import OutboxRelay
from services.core.telemetry import configure_logging


class StallingRelay(OutboxRelay):
    async def mark_published(self, conn: psycopg.AsyncConnection, ids: Sequence[int]) -> None:
        print(f"acked {len(ids)}", flush=True)
        await asyncio.Event().wait()


async def main(database_url: str, bootstrap: str, topic: str) -> None:
    relay = StallingRelay(open_db(database_url), bootstrap, topic=topic, takeover_interval=0.1)
    task = asyncio.create_task(relay.run())
    await relay.is_leader.wait()
    print("leading", flush=True)
    await task


if __name__ == "__main__":
    configure_logging("relay-test")
    asyncio.run(main(*sys.argv[1:4]))
