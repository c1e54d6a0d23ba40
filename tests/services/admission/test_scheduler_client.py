"""Admission's calls to the scheduler cost latency at most: a scheduler that does not answer
leaves admission working."""

import asyncio

from services.admission.scheduler_client import SchedulerClient
from services.core.fleet import FleetView

UNREACHABLE = "127.0.0.1:9"


async def test_a_silent_scheduler_reads_as_an_empty_queue_and_cancels_nothing() -> None:
    client = SchedulerClient(UNREACHABLE)
    try:
        assert await client.fleet() is None
        assert await client.cancel("run_x", "test") is False
        client.view = FleetView(num_interactive=7, max_run_tokens={"m": 40})
        watch = asyncio.create_task(client.watch_fleet())
        for _ in range(100):
            if client.view == FleetView():
                break
            await asyncio.sleep(0.05)
        watch.cancel()
        assert client.view == FleetView()
    finally:
        await client.close()
