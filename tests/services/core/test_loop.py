import asyncio

import pytest
import uvloop

from services.core.config import ConfigError
from services.core.loop import run


async def loop_type() -> type:
    return type(asyncio.get_running_loop())


def test_services_run_on_uvloop_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOLLGATE_EVENT_LOOP", raising=False)
    assert run(loop_type()) is uvloop.Loop


def test_asyncio_s_own_loop_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOLLGATE_EVENT_LOOP", "asyncio")
    loop = run(loop_type())
    assert issubclass(loop, asyncio.BaseEventLoop)
    assert loop is not uvloop.Loop


def test_an_unknown_loop_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOLLGATE_EVENT_LOOP", "trio")
    main = loop_type()
    with pytest.raises(ConfigError, match="TOLLGATE_EVENT_LOOP must be one of uvloop, asyncio"):
        run(main)
    assert main.cr_frame is None  # closed, not left to warn that it was never awaited
