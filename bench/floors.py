"""`python -m bench.floors`: what the services' two basic moves cost on this machine, the
floors under `bench.stack`'s CPU per run.

* A message a gRPC server streams (grpc.aio, as admission streams a run's events and live
  tokens to its client), and a unary call: CPU of the server process per message or call,
  and of the client's. The server runs in a process of its own.
* A statement a service sends PostgreSQL (SQLAlchemy's async pool and psycopg, one
  statement as its own transaction, as `single_statement` does), and the same on plain
  psycopg connections: CPU of the sending process and of PostgreSQL per statement (the
  latter read from /proc in clock ticks: coarse for so light a statement).

Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import psutil
import psycopg

from bench.cpu import BENCH, ENGINE, CpuWindow
from bench.report import progress

METHOD = "/tollgate.bench.Floor/Stream"
# About a live token's RunEvent: ids, a word of text, the run's id and its position.
PAYLOAD = bytes(96)


def _serve(port_queue: Any, stop: Any) -> None:
    async def stream(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        for _ in range(int.from_bytes(request, "big")):
            yield PAYLOAD

    async def main() -> None:
        server = grpc.aio.server()
        handler = grpc.method_handlers_generic_handler(
            "tollgate.bench.Floor",
            {"Stream": grpc.unary_stream_rpc_method_handler(stream)},
        )
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        port_queue.put(port)
        while not stop.is_set():
            await asyncio.sleep(0.2)
        await server.stop(0)

    asyncio.run(main())


async def _streams(address: str, num_streams: int, messages: int, rounds: int) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_stream(METHOD)
        received = 0

        async def one() -> None:
            nonlocal received
            for _ in range(rounds):
                async for _message in call(messages.to_bytes(4, "big")):
                    received += 1

        await asyncio.gather(*(one() for _ in range(num_streams)))
        return received


def grpc_floor(num_streams: int, messages: int, rounds: int) -> dict[str, float]:
    """CPU microseconds per streamed message (server, client) with `messages` per call."""
    spawn = multiprocessing.get_context("spawn")
    ports, stop = spawn.Queue(), spawn.Event()
    server = spawn.Process(target=_serve, args=(ports, stop), daemon=True)
    server.start()
    try:
        address = f"127.0.0.1:{ports.get(timeout=60)}"
        asyncio.run(_streams(address, num_streams, messages, 1))  # connected and warm
        with CpuWindow() as window:
            received = asyncio.run(_streams(address, num_streams, messages, rounds))
    finally:
        stop.set()
        server.join(10)
    per = 1e6 / max(received, 1)
    return {
        "server_us": round(window.seconds.get(ENGINE, 0.0) * per, 1),
        "client_us": round(window.seconds.get(BENCH, 0.0) * per, 1),
        "messages": received,
    }


def _postgres_seconds(data_dir: Path) -> float:
    """CPU seconds of the PostgreSQL server whose data directory is under `data_dir` and
    of its backends (it runs detached, no child of this process)."""
    total = 0.0
    for process in psutil.process_iter(["cmdline"]):
        if any(str(data_dir) in arg for arg in process.info["cmdline"] or ()):
            with contextlib.suppress(psutil.Error):
                for each in (process, *process.children(recursive=True)):
                    times = each.cpu_times()
                    total += times.user + times.system
    return total


async def _statements(database_url: str, concurrency: int, count: int) -> CpuWindow:
    from services.core.db import driver_cursor, open_db, single_statement

    db = open_db(database_url, pool_size=concurrency)

    async def some(n: int) -> None:
        for i in range(n):
            async with single_statement(db) as conn, driver_cursor(conn) as cursor:
                await cursor.execute("SELECT %s::bigint AS n", (i,))
                await cursor.fetchone()

    await asyncio.gather(*(some(2) for _ in range(concurrency)))  # the pool's connections open
    with CpuWindow() as window:
        await asyncio.gather(*(some(count // concurrency) for _ in range(concurrency)))
    await db.dispose()
    return window


async def _raw_statements(database_url: str, concurrency: int, count: int) -> CpuWindow:
    """The same statements on psycopg connections of their own, in autocommit: what the
    pool and SQLAlchemy add is the difference."""
    from services.core.db import libpq_url

    connections = [
        await psycopg.AsyncConnection.connect(libpq_url(database_url), autocommit=True)
        for _ in range(concurrency)
    ]

    async def some(conn: psycopg.AsyncConnection[Any], n: int) -> None:
        for i in range(n):
            cursor = await conn.execute("SELECT %s::bigint AS n", (i,))
            await cursor.fetchone()

    await asyncio.gather(*(some(conn, 2) for conn in connections))
    with CpuWindow() as window:
        await asyncio.gather(*(some(conn, count // concurrency) for conn in connections))
    for conn in connections:
        await conn.close()
    return window


def statement_floor(concurrency: int, count: int, raw: bool = False) -> dict[str, float]:
    """CPU microseconds per one-statement transaction (sender, PostgreSQL); `raw`: on
    psycopg connections, not through the services' pool."""
    send = _raw_statements if raw else _statements
    from services.stack.infra import LocalInfra

    with tempfile.TemporaryDirectory(prefix="tollgate-floors-") as scratch:
        with LocalInfra(Path(scratch)) as endpoints:
            before = _postgres_seconds(Path(scratch))
            window = asyncio.run(send(endpoints.database_url, concurrency, count))
            postgres = _postgres_seconds(Path(scratch)) - before
    per = 1e6 / count
    return {
        "sender_us": round(window.seconds.get(BENCH, 0.0) * per, 1),
        "postgres_us": round(postgres * per, 1),
        "statements": count,
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.floors", description=__doc__)
    parser.add_argument("--streams", type=int, default=64, help="concurrent gRPC streams")
    parser.add_argument("--messages", type=int, default=64, help="messages per stream")
    parser.add_argument("--rounds", type=int, default=20, help="calls per stream")
    parser.add_argument("--statements", type=int, default=8000)
    parser.add_argument("--concurrency", type=int, default=16, help="statements in flight")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    progress(f"gRPC: {args.streams} streams of {args.messages} messages x {args.rounds}")
    streamed = grpc_floor(args.streams, args.messages, args.rounds)
    progress(f"gRPC: {args.streams} streams of one message x {args.rounds * 8}")
    unary = grpc_floor(args.streams, 1, args.rounds * 8)
    progress(f"PostgreSQL: {args.statements} statements, {args.concurrency} in flight")
    started = time.perf_counter()
    statements = statement_floor(args.concurrency, args.statements)
    raw = statement_floor(args.concurrency, args.statements, raw=True)
    progress(f"PostgreSQL: {time.perf_counter() - started:.1f} s with its starts")
    print("| move | sender's CPU, us | other side's CPU, us |")
    print("|---|---:|---:|")
    print(f"| a streamed gRPC message | {streamed['server_us']} | {streamed['client_us']} |")
    print(f"| a gRPC call of one message | {unary['server_us']} | {unary['client_us']} |")
    print(f"| a statement | {statements['sender_us']} | {statements['postgres_us']} |")
    print(f"| a statement, raw psycopg | {raw['sender_us']} | {raw['postgres_us']} |")
    summary = {"streamed": streamed, "unary": unary, "statement": statements, "raw": raw}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
