"""Shutdown: background tasks stop within bounded time, even one stuck in its clean-up."""

import asyncio
import time

from services.core.server import stop_tasks


async def test_a_task_stuck_in_its_clean_up_is_cancelled_again() -> None:
    cleaned: list[str] = []

    async def stubborn() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.Event().wait()  # like a commit retried against a broker that is gone
            cleaned.append("never")

    async def polite() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            cleaned.append("polite")

    async def failed() -> None:
        raise RuntimeError("failed before shutdown")

    tasks = [asyncio.ensure_future(job()) for job in (stubborn, polite, failed)]
    await asyncio.sleep(0)
    started = time.monotonic()
    await stop_tasks(tasks, grace=0.2)
    assert time.monotonic() - started < 2
    assert all(task.done() for task in tasks)
    assert tasks[0].cancelled() and cleaned == ["polite"]


async def test_tasks_that_stop_at_once_take_no_grace() -> None:
    task = asyncio.ensure_future(asyncio.Event().wait())
    started = time.monotonic()
    await stop_tasks([task], grace=30)
    assert task.cancelled() and time.monotonic() - started < 1
