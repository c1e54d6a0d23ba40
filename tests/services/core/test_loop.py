import asyncio

import pytest
import uvloop

from services.core.config import ConfigError
from services.core.loop import run, running_loop_name


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
