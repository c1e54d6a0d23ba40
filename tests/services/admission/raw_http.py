"""HTTP/1.1 written by hand on real sockets to an in-process `HttpServer`: what no client
library sends (a request left half-sent, a header that never ends, a body past a bound),
and from which loopback address."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from services.admission.http.limits import DEFAULT_LIMITS, HttpLimits
from services.admission.http.server import HttpServer


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@contextlib.asynccontextmanager
async def serving(app: ASGIApp, limits: HttpLimits = DEFAULT_LIMITS) -> AsyncIterator[int]:
    """`app` served on a free loopback port (yielded) with `limits`."""
    server = HttpServer(app, "127.0.0.1:0", limits=limits)
    task = asyncio.create_task(server.run())
    try:
        yield int(server.address.rpartition(":")[2])
    finally:
        await server.stop()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def connect(
    port: int, source: str = "127.0.0.1"
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


async def exchange(
    port: int, data: bytes, *, source: str = "127.0.0.1", timeout: float = 10.0
) -> Answer | None:
    """Sends `data` on a new connection from `source`, then reads until the server closes
    it (a request should say `connection: close`); None when it closed without answering.
    Raises TimeoutError when the server neither answers nor closes within `timeout`."""
    reader, writer = await connect(port, source)
    try:
        writer.write(data)
        await writer.drain()
        return parse(await asyncio.wait_for(reader.read(), timeout))
    finally:
        writer.close()


async def answer_of(reader: asyncio.StreamReader, timeout: float = 10.0) -> Answer | None:
    return parse(await asyncio.wait_for(reader.read(), timeout))


def parse(raw: bytes) -> Answer | None:
    if not raw:
        return None
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return Answer(int(status_line.split()[1]), headers, body)


def request(
    method: str, path: str, headers: dict[str, str] | None = None, body: bytes = b""
) -> bytes:
    """A whole request that asks the server to close the connection after its answer."""
    lines = [f"{method} {path} HTTP/1.1", "host: tollgate", "connection: close"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    if body:
        lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


async def body_length(scope: Scope, receive: Receive, send: Send) -> None:
    """An ASGI app that reads the whole body and answers its length."""
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        size += len(message.get("body", b""))
        if not message.get("more_body", False):
            break
    payload = str(size).encode()
    headers = [(b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
