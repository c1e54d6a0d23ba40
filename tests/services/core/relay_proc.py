"""A relay process that stops dead after the broker acknowledges its first batch.

Run as `python -m tests.services.core.relay_proc DATABASE_URL BOOTSTRAP TOPIC`;
it prints `acked N` once a batch of N events is acknowledged, and then stops its event
loop dead (never marking the batch published) until it is killed.
"""

import asyncio
import sys
import threading
from collections.abc import Mapping

from services.core.db import open_db
from services.core.kafka import Placed
from services.core.relay import OutboxRelay
from services.core.telemetry import configure_logging


class StallingRelay(OutboxRelay):
    def mark_published(self, acked: Mapping[int, Placed]) -> None:
        print(f"acked {len(acked)}", flush=True)
        threading.Event().wait()


async def main(database_url: str, bootstrap: str, topic: str) -> None:
    relay = StallingRelay(open_db(database_url), bootstrap, topic=topic, takeover_interval=0.1)
    task = asyncio.create_task(relay.run())
    await relay.is_leader.wait()
    print("leading", flush=True)
    await task


if __name__ == "__main__":
    configure_logging("relay-test")
    asyncio.run(main(*sys.argv[1:4]))
