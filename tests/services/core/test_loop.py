import asyncio
import contextlib

import pytest
import uvloop

from services.core.config import ConfigError
from services.core.loop import run, running_loop_name, stop_if_cancelled, wait_set, within


async def running_loop() -> tuple[type, str]:
    return type(asyncio.get_running_loop()), running_loop_name()


def test_services_run_on_uvloop_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOLLGATE_EVENT_LOOP", raising=False)
    assert run(running_loop()) == (uvloop.Loop, "uvloop")


def test_asyncio_s_own_loop_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOLLGATE_EVENT_LOOP", "asyncio")
    loop, name = run(running_loop())
    assert issubclass(loop, asyncio.BaseEventLoop) and loop is not uvloop.Loop
    assert name == "asyncio"


def test_an_unknown_loop_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOLLGATE_EVENT_LOOP", "trio")
    main = running_loop()
    with pytest.raises(ConfigError, match="TOLLGATE_EVENT_LOOP must be one of uvloop, asyncio"):
        run(main)
    assert main.cr_frame is None  # closed, not left to warn that it was never awaited


@pytest.mark.parametrize("turns", range(6))
async def test_a_cancellation_in_the_turn_the_result_arrives_still_cancels(turns: int) -> None:
    queue: asyncio.Queue[str] = asyncio.Queue()
    task = asyncio.create_task(within(queue.get(), 60))
    await asyncio.sleep(0)  # waiting for the item
    queue.put_nowait("item")
    for _ in range(turns):
        await asyncio.sleep(0)
    if task.cancel():  # the task had not finished: it must end cancelled
        with pytest.raises(asyncio.CancelledError):
            await task
    else:
        assert task.result() == "item"


async def test_within_raises_timeout_and_wait_set_says_whether_it_was_set() -> None:
    with pytest.raises(TimeoutError):
        await within(asyncio.Event().wait(), 0.01)
    event = asyncio.Event()
    assert not await wait_set(event, 0.01)
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await wait_set(event, 60)


async def test_a_loop_stops_though_a_library_swallowed_its_cancellation() -> None:
    turns = 0

    async def service_loop() -> None:
        nonlocal turns
        while True:
            stop_if_cancelled()
            turns += 1
            with contextlib.suppress(asyncio.CancelledError):  # a library that swallows it
                await asyncio.sleep(60)

    task = asyncio.create_task(service_loop())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)
    assert turns == 1
