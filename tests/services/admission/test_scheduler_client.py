"""Admission's calls to the scheduler cost latency at most: a scheduler that does not answer
leaves admission working."""

import asyncio

from services.admission.scheduler_client import QueueDepth, SchedulerClient

UNREACHABLE = "127.0.0.1:9"


async def test_a_silent_scheduler_reads_as_an_empty_queue_and_cancels_nothing() -> None:
    client = SchedulerClient(UNREACHABLE)
    try:
        assert await client.queue_depth() == 0
        assert await client.cancel("run_x", "test") is False
        depth = QueueDepth()
        depth.value = 7
        watch = asyncio.create_task(client.watch_queue_depth(depth))
        for _ in range(100):
            if depth.value == 0:
                break
            await asyncio.sleep(0.05)
        watch.cancel()
        assert depth.value == 0
    finally:
        await client.close()
