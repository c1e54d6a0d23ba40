"""uvicorn's httptools protocol with limits on each connection, enforced as its bytes
arrive and before any request reaches the app: connections open at once in the process
and from one client address (503 and closed at once past them), the bytes and the count
of a request's headers (431 and closed, the rest never read), and deadlines for the
headers and for the body (408 and closed). uvicorn bounds none of these itself."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

from services.admission.http.limits import HttpLimits, is_within
from services.admission.http.responses import error_body

# Status -> (OpenAI error type, code) of the answers given here.
REFUSALS = {
    408: ("invalid_request_error", "request_timeout"),
    431: ("invalid_request_error", "request_header_fields_too_large"),
    503: ("service_unavailable", "too_many_connections"),
}


class ConnectionCounts:
    """The connections a server holds open, in all and per client address; a trusted
    proxy's address has no cap of its own (its clients are behind it)."""

    def __init__(self, limits: HttpLimits) -> None:
        self.max_connections = limits.max_connections
        self.max_per_client = limits.max_connections_per_client
        self.proxies = limits.proxy_networks()
        self.num_open = 0
        self.by_client: dict[str, int] = {}

    def open(self, host: str) -> str | None:
        """Counts a new connection from `host`; else (uncounted) says why it is refused."""
        if self.num_open >= self.max_connections:
            return "the server holds as many connections as it may; retry shortly"
        held = self.by_client.get(host, 0)
        if held >= self.max_per_client and not is_within(host, self.proxies):
            return "too many connections from this address; retry shortly"
        self.num_open += 1
        self.by_client[host] = held + 1
        return None

    def close(self, host: str) -> None:
        self.num_open -= 1
        held = self.by_client.pop(host) - 1
        if held:
            self.by_client[host] = held


class TooManyHeaders(Exception):
    pass


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """One connection. `limited_protocol` makes the class for a server: its connections
    share `counts`."""

    limits: ClassVar[HttpLimits]
    counts: ClassVar[ConnectionCounts]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._counted_host: str | None = None
        self._in_head = True
        self._num_head_bytes = 0
        self._num_headers = 0
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        host = self.client[0] if self.client else ""
        refusal = self.counts.open(host)
        if refusal is not None:
            self._refuse(503, refusal)
            return
        self._counted_host = host
        self._arm(self.limits.header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._counted_host is not None:
            self.counts.close(self._counted_host)
            self._counted_host = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """Feeds the parser no more of a request's line and headers than the limit."""
        limit = self.limits.max_header_bytes
        idle = self.cycle is None or self.cycle.response_complete
        if data and self._in_head and self._deadline is None and idle:
            # Any byte starts the headers' time, even blank lines, which the parser skips
            # without beginning a message (and which stop uvicorn's keep-alive timer).
            self._arm(self.limits.header_timeout)
        while data and not self.transport.is_closing():
            if self._in_head:
                room = limit - self._num_head_bytes
                if room <= 0:
                    break
                chunk, data = data[:room], data[room:]
                self._num_head_bytes += len(chunk)
            else:
                chunk, data = data, b""
            super().data_received(chunk)
        if self._in_head and self._num_head_bytes >= limit and not self.transport.is_closing():
            self._refuse(431, f"the request line and headers are over {limit} bytes")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._deadline is None:
            self._arm(self.limits.header_timeout)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._num_headers += 1
        if self._num_headers > self.limits.max_headers:
            raise TooManyHeaders  # stops the parser; `send_400_response` tells the client
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._arm(self.limits.body_timeout)
        before = self.cycle
        super().on_headers_complete()
        if self.cycle is not before:
            # Looked up when the request's task first runs, which is later.
            self.cycle.receive = _body_outlives_hangup(self.cycle)  # type: ignore[method-assign,assignment]

    def on_message_complete(self) -> None:
        self._disarm()
        self._in_head, self._num_head_bytes, self._num_headers = True, 0, 0
        super().on_message_complete()

    def send_400_response(self, msg: str) -> None:
        if self._num_headers > self.limits.max_headers:
            self._refuse(431, f"a request may carry {self.limits.max_headers} headers at most")
        else:
            super().send_400_response(msg)

    def _arm(self, delay: float) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(delay, self._timed_out)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _timed_out(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            # The app waiting on the body is told the client left, and answers nothing.
            cycle.disconnected = True
            cycle.message_event.set()
            if cycle.response_started:
                self.transport.close()  # the answer was cut: nothing else may be written
                return
        part = "headers" if self._in_head else "body"
        timeout = self.limits.header_timeout if self._in_head else self.limits.body_timeout
        self._refuse(408, f"the request's {part} did not arrive within {timeout:g} s")

    def _refuse(self, status: int, message: str) -> None:
        """Answers `status` with an OpenAI error body and closes the connection."""
        error_type, code = REFUSALS[status]
        body = json.dumps(error_body(message, error_type, None, code)).encode()
        head = [
            STATUS_LINE[status],
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"x-request-id: req_%s\r\n" % uuid.uuid4().hex.encode(),
            b"retry-after: 1\r\n" if status == 503 else b"",
            b"connection: close\r\n\r\n",
        ]
        self.transport.write(b"".join(head) + body)
        self.transport.close()


def _body_outlives_hangup(cycle: RequestResponseCycle) -> Callable[[], Awaitable[Any]]:
    """`cycle.receive`, except that a body that arrived whole is given to the app even when
    the client hung up before the app read it (uvicorn's says only `http.disconnect`):
    the guard checks the key before it reads, and a request sent whole, then left, still
    runs (its run cancelled after its disconnect grace, as any other)."""
    receive = cycle.receive
    ended = False  # the body's last part was given

    async def body_first() -> Any:
        nonlocal ended
        if not ended and cycle.disconnected and not cycle.more_body:
            ended = True
            body, cycle.body = bytes(cycle.body), bytearray()
            return {"type": "http.request", "body": body, "more_body": False}
        message = await receive()
        ended = ended or message["type"] != "http.request" or not message.get("more_body")
        return message

    return body_first


def limited_protocol(limits: HttpLimits) -> type[LimitedHttpToolsProtocol]:
    """The protocol class of one server, whose connections `limits` bounds together."""

    class Protocol(LimitedHttpToolsProtocol):
        pass

    Protocol.limits = limits
    Protocol.counts = ConnectionCounts(limits)
    return Protocol
