"""The limits every connection to the HTTP port meets, on real sockets: connections per
process and per client address, the size and count of a request's headers, and deadlines
for the headers and the body; a slow-loris from one address leaves others served."""

from __future__ import annotations

import asyncio
import resource
import time
from dataclasses import replace
from pathlib import Path

import pytest

from services.admission.http.app import create_app
from services.admission.http.limits import DEFAULT_LIMITS
from tests.services.admission.raw_http import (
    answer_of,
    body_length,
    connect,
    exchange,
    request,
    serving,
)
from tests.services.admission.running import Admission

QUICK = replace(DEFAULT_LIMITS, header_timeout=0.5, body_timeout=0.5)
MiB = 1024 * 1024


async def test_connections_past_the_per_client_and_process_caps_are_refused_at_once() -> None:
    limits = replace(DEFAULT_LIMITS, max_connections=4, max_connections_per_client=2)
    async with serving(body_length, limits) as port:
        held = [await connect(port) for _ in range(2)]
        await asyncio.sleep(0.2)  # accepted
        third = await exchange(port, request("GET", "/"), timeout=5)
        assert third is not None and third.status == 503, third
        assert third.json()["error"]["code"] == "too_many_connections"
        assert third.headers["retry-after"] == "1"
        other = await exchange(port, request("GET", "/"), source="127.0.0.2")
        assert other is not None and other.status == 200, other

        held += [await connect(port, "127.0.0.3") for _ in range(2)]
        await asyncio.sleep(0.2)
        refused = await exchange(port, request("GET", "/"), source="127.0.0.4", timeout=5)
        assert refused is not None and refused.status == 503, refused

        # A connection closed is a place free again.
        held.pop()[1].close()
        await asyncio.sleep(0.2)
        again = await exchange(port, request("GET", "/"), source="127.0.0.4")
        assert again is not None and again.status == 200, again
        for _, writer in held:
            writer.close()


async def test_headers_past_their_count_or_size_are_a_431() -> None:
    limits = replace(DEFAULT_LIMITS, max_headers=10, max_header_bytes=4096)
    async with serving(body_length, limits) as port:
        many = request("GET", "/", {f"x-{i}": "1" for i in range(10)})  # with host, connection
        answer = await exchange(port, many, timeout=5)
        assert answer is not None and answer.status == 431, answer
        assert answer.headers["connection"] == "close"

        # The head never ends: refused once the bound is read, not waited for.
        endless = b"GET / HTTP/1.1\r\nx-long: " + b"a" * (4096 - 24)
        assert len(endless) == 4096
        answer = await exchange(port, endless, timeout=5)
        assert answer is not None and answer.status == 431, answer

        within = request("GET", "/", {"x-long": "a" * 3000})
        answer = await exchange(port, within)
        assert answer is not None and answer.status == 200, answer


async def test_an_endless_header_is_cut_off_without_the_server_holding_it() -> None:
    chunk = b"a" * MiB
    total = 64 * MiB
    async with serving(body_length) as port:
        before = _rss()
        reader, writer = await connect(port)
        sent = 0
        with pytest.raises(ConnectionError):
            writer.write(b"GET / HTTP/1.1\r\nx-endless: ")
            async with asyncio.timeout(30):
                while sent < total:
                    writer.write(chunk)
                    await writer.drain()
                    sent += len(chunk)
                # The server read it all: it should have stopped long before.
                raise AssertionError(f"{sent} bytes sent, none refused")
        writer.close()
        assert sent < total // 2
        assert _rss() - before < 16 * MiB


async def test_a_half_sent_request_is_closed_after_its_deadline() -> None:
    async with serving(body_length, QUICK) as port:
        started = time.monotonic()
        answer = await exchange(port, b"GET / HT", timeout=5)
        assert answer is not None and answer.status == 408, answer
        assert "headers" in answer.json()["error"]["message"]

        reader, writer = await connect(port)  # says nothing at all
        answer = await answer_of(reader, timeout=5)
        writer.close()
        assert answer is not None and answer.status == 408, answer

        part = request("POST", "/", body=b"x" * 100)[:-90]
        answer = await exchange(port, part, timeout=5)
        assert answer is not None and answer.status == 408, answer
        assert "body" in answer.json()["error"]["message"]
        assert time.monotonic() - started < 5

        # A whole request is answered, and the deadlines do not outlive it.
        reader, writer = await connect(port)
        writer.write(request("POST", "/", body=b"x" * 100).replace(b"close", b"keep-alive"))
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), 5)
        assert line.startswith(b"HTTP/1.1 200"), line
        assert not await _closes(reader, within=1.0)
        writer.close()


async def test_blank_lines_after_a_request_do_not_hold_a_connection_open() -> None:
    limits = replace(QUICK, header_timeout=1.0)
    async with serving(body_length, limits) as port:
        reader, writer = await connect(port)
        writer.write(request("POST", "/", body=b"x").replace(b"close", b"keep-alive"))
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), 5)
        assert line.startswith(b"HTTP/1.1 200"), line
        started = time.monotonic()
        closed = False
        while not closed and time.monotonic() - started < 6:
            # The parser skips blank lines; each stops uvicorn's keep-alive timer.
            writer.write(b"\r\n")
            await writer.drain()
            closed = await _closes(reader, within=0.3)
        writer.close()
        assert closed and time.monotonic() - started < 3


@pytest.mark.slow
async def test_a_slow_loris_from_one_address_leaves_other_clients_served(
    admission: Admission,
) -> None:
    """2,000 connections from 127.0.0.1 each send part of a request and stop."""
    num_loris = 2000
    _raise_open_files(2 * num_loris + 1000)
    _, key = await admission.new_tenant_key("patient")
    limits = replace(DEFAULT_LIMITS, header_timeout=3.0)
    async with serving(create_app(admission.core, limits), limits) as port:
        loris = []
        for _ in range(num_loris // 100):
            batch = await asyncio.gather(*(connect(port) for _ in range(100)))
            for _, writer in batch:
                writer.write(b"GET /v1/models HTTP/1.1\r\nhost: tollgate\r\n")
            loris += batch
        started = time.monotonic()
        wanted = request("GET", "/v1/models", {"authorization": f"Bearer {key}"})
        answer = await exchange(port, wanted, source="127.0.0.2", timeout=5)
        assert answer is not None and answer.status == 200, answer
        assert time.monotonic() - started < 2

        # Past its cap, the address's connections were refused at once; the rest, at the
        # header deadline.
        closed = await asyncio.gather(*(_closes(reader, within=0.5) for reader, _ in loris))
        assert sum(closed) >= num_loris - limits.max_connections_per_client
        held = [reader for (reader, _), gone in zip(loris, closed, strict=True) if not gone]
        deadline = limits.header_timeout + 1.0
        assert all(await asyncio.gather(*(_closes(reader, within=deadline) for reader in held)))
        for _, writer in loris:
            writer.close()


async def _closes(reader: asyncio.StreamReader, within: float) -> bool:
    """Whether the server closes the connection within `within` seconds (what it wrote
    before is read and dropped)."""
    try:
        await asyncio.wait_for(reader.read(), within)
    except TimeoutError:
        return False
    return True


def _rss() -> int:
    """This process's resident memory, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _raise_open_files(wanted: int) -> None:
    """Client and server ends live in this process: raises the soft limit on open files."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= wanted:
        return
    if hard != resource.RLIM_INFINITY and hard < wanted:
        pytest.skip(f"needs {wanted} open files; the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
