"""The Batch API's driver: one admission replica at a time (the holder of an advisory
lock, `services.core.leadership`) moves every open batch along.

Each line of a batch is a run of the batch class, started through the same `Gateway` as
a request to its endpoint would be (the batch creator's key and tenant, their quotas, the
batch discount when billed), detached (no client holds it), with the idempotency key
`line_key(batch_id, custom_id)`: however often a line is submitted (a driver that died
between starting a run and recording it, a new leader going over the same lines), it
has one run. Lines are submitted in order, at most `in_flight` of a batch's runs
unended at once, so a large batch queues behind interactive work in the scheduler
rather than flooding it. A refusal that passes (RESOURCE_EXHAUSTED: a quota;
UNAVAILABLE: the queue is full) holds the batch's submissions until its `retry_after`;
any other refusal ends that line in the error file.

A batch all of whose lines ended is `finalizing`, then `completed` with its output and
error files, both written with the status in one transaction. Cancelling (a client's
`cancel`) and expiry (`expires_at` passed) cancel the batch's unended runs, wait for them
to end, and write the files likewise (`cancelled`, `expired`); a line that never ran is
an error line (`batch_cancelled`, `batch_expired`). Everything the driver knows is in
the database, so a driver killed at any point is replaced by one that carries on.

The driver wakes on the `tollgate_batches` notice (a batch created or cancelled) and, while
batches are open, every `interval` seconds.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import psycopg
import sqlalchemy as sa
import structlog
from sqlalchemy.engine import RowMapping
from sqlalchemy.ext.asyncio import AsyncConnection

from services.admission.batch_store import (
    finish,
    line_counts,
    move,
    open_batches,
    record_line,
    recorded_lines,
    running_runs,
)
from services.admission.file_store import (
    NewFile,
    find_file,
    read_lines,
    write_chunk,
    write_file,
)
from services.admission.gateway import Gateway
from services.admission.http.answers import (
    BATCH_CANCELLED,
    BATCH_EXPIRED,
    answered_line,
    output_line,
    stopped_line,
)
from services.admission.http.batches_api import CHUNK_BYTES, line_key, line_request, parse_line
from services.admission.http.responses import http_error
from services.core.errors import ApiError, QuotaExceeded, Unavailable
from services.core.leadership import Leadership

log = structlog.get_logger(__name__)

# Arbitrary constant naming the batch driver's advisory lock.
BATCH_LOCK_KEY = 0x62746368  # "btch"
CHANNEL = "tollgate_batches"
# How long a leader with no open batch waits for a notice before it looks anyway.
IDLE_WAIT_S = 60.0
DEFAULT_IN_FLIGHT = 128


class BatchDriver:
    def __init__(
        self, gateway: Gateway, *, in_flight: int = DEFAULT_IN_FLIGHT, interval: float = 1.0
    ) -> None:
        self.gateway = gateway
        self.db = gateway.db
        self.in_flight = in_flight
        self.interval = interval
        self.leadership = Leadership(self.db, BATCH_LOCK_KEY, name="batches")
        # Per batch: its input's lines from the next one to submit (this leader's own).
        self._cursors: dict[str, AsyncIterator[tuple[int, bytes]]] = {}
        # Per batch: no submission before this monotonic time (a quota's retry-after).
        self._held_until: dict[str, float] = {}

    async def run(self) -> None:
        await self.leadership.run(self._lead)

    async def _lead(self, conn: psycopg.AsyncConnection) -> None:
        self._cursors.clear()
        await conn.execute(f"LISTEN {CHANNEL}")
        while True:
            if await self.step():
                await asyncio.sleep(self.interval)
                continue
            # Idle: until a notice (one sent meanwhile is kept by the connection).
            async for _ in conn.notifies(timeout=IDLE_WAIT_S, stop_after=1):
                pass

    async def step(self) -> bool:
        """Moves every open batch along once; whether any is open."""
        rows = await open_batches(self.db)
        for row in rows:
            try:
                await self._advance(row)
            except Exception:  # one batch's trouble does not stop the others
                log.exception("batch step failed", batch_id=row["batch_id"])
        return bool(rows)

    async def _advance(self, row: RowMapping) -> None:
        batch_id, status = row["batch_id"], row["status"]
        if status == "validating":
            if await find_file(self.db, row["tenant_id"], row["input_file_id"]) is None:
                errors = [{"code": "file_not_found", "message": "the input file was deleted"}]
                await move(self.db, batch_id, ["validating"], "failed", errors=errors)
                return
            await move(self.db, batch_id, ["validating"], "in_progress")
            return
        if status == "finalizing":
            expired = row["finalizing_at"] >= row["expires_at"]
            await self._finalize(row, "expired" if expired else "completed")
            return
        stopping = status == "cancelling" or datetime.now(UTC) >= row["expires_at"]
        if stopping:
            if await self._stop_runs(batch_id, status):
                return  # runs still ending
            if status == "cancelling":
                await self._finalize(row, "cancelled")
                return
        counts = (await line_counts(self.db, [batch_id])).get(batch_id)
        submitted = counts.submitted if counts else 0
        ended = counts.ended if counts else 0
        if not stopping and submitted < row["total"]:
            await self._submit(row, submitted, submitted - ended)
            return
        if stopping or ended == row["total"]:
            moved = await move(self.db, batch_id, ["in_progress"], "finalizing")
            if moved is not None:
                await self._advance(moved)

    async def _stop_runs(self, batch_id: str, status: str) -> bool:
        """Cancels the batch's unended runs; whether any had not ended."""
        run_ids = await running_runs(self.db, batch_id)
        reason = "batch cancelled" if status == "cancelling" else "batch expired"
        for run_id in run_ids:
            run = await self.gateway.store.get_run(run_id)
            if run is not None:
                await self.gateway.canceller.cancel(run, reason)
        return bool(run_ids)

    async def _submit(self, row: RowMapping, submitted: int, running: int) -> None:
        """Starts the batch's next lines, up to `in_flight` of its runs unended."""
        batch_id = row["batch_id"]
        if time.monotonic() < self._held_until.get(batch_id, 0.0):
            return
        lines = self._cursors.get(batch_id)
        if lines is None:
            lines = self._cursors[batch_id] = _numbered(read_lines(self.db, row["input_file_id"]))
        try:
            await self._submit_from(row, lines, submitted, running)
        except BaseException:
            # The line it stopped at may be started and not recorded: the next step reads
            # the file from the start, after the lines recorded, and starts that one again
            # (its idempotency key finds its run).
            self._cursors.pop(batch_id, None)
            raise

    async def _submit_from(
        self, row: RowMapping, lines: AsyncIterator[tuple[int, bytes]], submitted: int, running: int
    ) -> None:
        batch_id = row["batch_id"]
        while running < self.in_flight:
            try:
                number, raw = await anext(lines)
            except StopAsyncIteration:
                return
            if number <= submitted:
                continue  # submitted by an earlier leader
            try:
                run_id = await self._start(row, number, raw)
            except (QuotaExceeded, Unavailable) as refused:
                self._held_until[batch_id] = time.monotonic() + max(refused.retry_after, 1.0)
                self._cursors[batch_id] = _again(number, raw, lines)
                return
            except ApiError as refused:
                answer = http_error(refused)
                error = {"status_code": answer.status, "body": answer.body}
                await record_line(self.db, batch_id, number, None, error)
                continue
            await record_line(self.db, batch_id, number, run_id, None)
            running += 1

    async def _start(self, row: RowMapping, number: int, raw: bytes) -> str:
        line = parse_line(raw, number)
        params = line_request(line.url, line.body, self.gateway.config.limits).params
        params = replace(params, idempotency_key=line_key(row["batch_id"], line.custom_id))
        started = await self.gateway.start(row["tenant_id"], params, row["key_id"])
        # No stream follows a line's run: its place among the tenant's streams is free.
        self.gateway.streams.release(row["tenant_id"], started.run_id)
        return started.run_id

    async def _finalize(self, row: RowMapping, to: str) -> None:
        """Writes the batch's output and error files and moves it to `to`, in one
        transaction."""
        batch_id, tenant_id = row["batch_id"], row["tenant_id"]
        self._cursors.pop(batch_id, None)
        self._held_until.pop(batch_id, None)
        stopped = {"cancelled": BATCH_CANCELLED, "expired": BATCH_EXPIRED}.get(to, "")
        recorded = await recorded_lines(self.db, batch_id)
        output = _FileWriter(NewFile(tenant_id, "batch_output", f"{batch_id}_output.jsonl"))
        errors = _FileWriter(NewFile(tenant_id, "batch_output", f"{batch_id}_error.jsonl"))
        async with self.db.begin() as conn:
            number = 0
            async for raw in read_lines(self.db, row["input_file_id"]):
                number += 1
                ok, answer = await self._answer(batch_id, tenant_id, number, raw, recorded, stopped)
                await (output if ok else errors).add(conn, answer)
            values = {
                "output_file_id": await output.close(conn),
                "error_file_id": await errors.close(conn),
            }
            if await finish(conn, batch_id, to, values) is None:
                raise RuntimeError(f"batch {batch_id} was finished by another driver")
        log.info("batch finished", batch_id=batch_id, status=to, lines=number)

    async def _answer(
        self,
        batch_id: str,
        tenant_id: str,
        number: int,
        raw: bytes,
        recorded: Mapping[int, RowMapping],
        stopped: str,
    ) -> tuple[bool, dict[str, Any]]:
        line = parse_line(raw, number)
        record = recorded.get(number)
        if record is None:
            return False, stopped_line(batch_id, line.custom_id, stopped or BATCH_CANCELLED)
        if record["error"] is not None:
            error = record["error"]
            return False, output_line(
                batch_id, line.custom_id, "", error["status_code"], error["body"]
            )
        request = line_request(line.url, line.body, self.gateway.config.limits)
        events = await self.gateway.store.read(record["run_id"])
        token_bytes = self.gateway.catalog.get(request.params.model).tokenizer.token_bytes
        return answered_line(
            batch_id, line, request, record["run_id"], tenant_id, events, token_bytes, stopped
        )


class _FileWriter:
    """A file of JSON lines written in chunks as lines come, in the caller's transaction."""

    def __init__(self, new: NewFile) -> None:
        self.new = new.with_id()
        self.pending = bytearray()
        self.chunks = 0
        self.size = 0
        self.lines = 0

    async def add(self, conn: AsyncConnection, line: Mapping[str, Any]) -> None:
        self.pending += json.dumps(line, separators=(",", ":")).encode() + b"\n"
        self.lines += 1
        if len(self.pending) >= CHUNK_BYTES:
            await self._flush(conn)

    async def close(self, conn: AsyncConnection) -> str | None:
        """Writes what is left and the file's row; its id, or None for a file of no lines."""
        if self.lines == 0:
            return None
        await self._flush(conn)
        await write_file(conn, replace(self.new, lines=self.lines), self.size)
        return self.new.file_id

    async def _flush(self, conn: AsyncConnection) -> None:
        if self.pending:
            await write_chunk(conn, self.new.file_id, self.chunks, bytes(self.pending))
            self.chunks += 1
            self.size += len(self.pending)
            self.pending.clear()


async def _numbered(lines: AsyncIterator[bytes]) -> AsyncIterator[tuple[int, bytes]]:
    number = 0
    async for line in lines:
        number += 1
        yield number, line


async def _again(
    number: int, raw: bytes, rest: AsyncIterator[tuple[int, bytes]]
) -> AsyncIterator[tuple[int, bytes]]:
    """`rest` with the line it gave last put back in front."""
    yield number, raw
    async for item in rest:
        yield item


async def notify_driver(conn: AsyncConnection) -> None:
    """Wakes the leading driver (a batch was created or cancelled)."""
    await conn.execute(sa.text(f"NOTIFY {CHANNEL}"))
