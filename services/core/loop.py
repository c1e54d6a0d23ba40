"""The event loop the services run on: uvloop by default, asyncio's own on request.

uvloop runs the same coroutines with less CPU per socket read, callback and timer,
and every run costs each service many of those. `TOLLGATE_EVENT_LOOP=asyncio`
chooses asyncio's loop, for its debug mode or to compare the two.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from services.core.config import env_choice

T = TypeVar("T")

EVENT_LOOPS = ("uvloop", "asyncio")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The configured loop's constructor; None for asyncio's default."""
    if env_choice("TOLLGATE_EVENT_LOOP", "uvloop", EVENT_LOOPS) == "asyncio":
        return None
    import uvloop

    return uvloop.new_event_loop


def running_loop_name() -> str:
    """The running loop's package: "uvloop" or "asyncio"."""
    return type(asyncio.get_running_loop()).__module__.partition(".")[0]


def run(main: Coroutine[Any, Any, T]) -> T:
    """Runs a service's main coroutine to the end on the configured loop."""
    try:
        factory = loop_factory()
    except BaseException:
        main.close()
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)


async def within(awaitable: Awaitable[T], timeout: float) -> T:
    """`awaitable`'s result, or TimeoutError after `timeout` seconds.

    Unlike `asyncio.wait_for` on Python 3.11, a cancellation that arrives in the same
    turn as the result is never swallowed: a cancelled task always stops."""
    async with asyncio.timeout(timeout):
        return await awaitable


async def wait_set(event: asyncio.Event, timeout: float) -> bool:
    """Whether `event` is set within `timeout` seconds (cancellable as `within` is)."""
    with contextlib.suppress(TimeoutError):
        await within(event.wait(), timeout)
    return event.is_set()


def stop_if_cancelled() -> None:
    """Raises CancelledError in a task that was cancelled while a library it awaited
    swallowed the cancellation, so that a service loop still stops."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
