from __future__ import annotations

import asyncio
import contextlib
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest

from services.admission.http.app import create_app
from services.admission.http.server import HttpServer
from services.console import ConsoleSettings, console_router
from tests.services.admission.conftest import admission
from tests.services.admission.raw_http import Answer
from tests.services.admission.running import ADMIN_TOKEN, Admission

__all__ = ["admission"]  # the fixture the console's runs on


@dataclass
class ConsoleServer:
    url: str
    admission: Admission

    async def call(
        self, path: str, secret: str | None = None, method: str = "GET", **headers: str
    ) -> Answer:
        sent = {k.replace("_", "-"): v for k, v in headers.items()}
        if secret is not None:
            sent["authorization"] = f"Bearer {secret}"
        request = urllib.request.Request(self.url + path, method=method, headers=sent)
        return await asyncio.to_thread(_send, request)

    async def json(self, path: str, secret: str, method: str = "GET") -> Any:
        answer = await self.call(path, secret, method)
        assert answer.status == 200, (answer.status, answer.body)
        return answer.json()


def _send(request: urllib.request.Request) -> Answer:
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return Answer(response.status, dict(response.headers.items()), response.read())
    except urllib.error.HTTPError as error:
        return Answer(error.code, dict(error.headers.items()), error.read())


@pytest.fixture
async def console(admission: Admission) -> AsyncIterator[ConsoleServer]:
    """The HTTP front door with the console, as admission serves it, without a scheduler."""
    app = create_app(admission.core)
    settings = ConsoleSettings(ADMIN_TOKEN, "USD", unbilled_grace=10.0)
    app.include_router(console_router(admission.core, settings, None))
    server = HttpServer(app, "127.0.0.1:0")
    task = asyncio.create_task(server.run())
    try:
        yield ConsoleServer(server.url, admission)
    finally:
        await server.stop()
        with contextlib.suppress(BaseException):
            await task
