"""Which runs clients are streaming, kept in PostgreSQL so that every admission replica
counts: a run is abandoned, and cancelled, once no replica has streamed it for its
disconnect grace.

Each replica holds a lease row per run it streams (`run_attachments`), renewed while a
stream lasts and expired at once when its last stream of the run ends. A replica that
dies stops renewing, so its runs are abandoned a lease later. Every replica sweeps for
abandoned runs; a run cancelled twice is cancelled once (the event store's optimistic
concurrency settles it).

A sweep also finds when the next run can be abandoned, as the rows stand, and the next
one waits until then: at most a lease (a row written meanwhile expires a lease after it
is written, at the soonest), at least `sweep_interval`, and no longer than that once a
stream of this replica ends (its run's grace starts then). An idle replica thus reads
the table once a lease, not twice a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable

import structlog
from sqlalchemy.ext.asyncio import AsyncConnection

from services.core.db import Database, driver_cursor, single_statement
from services.core.errors import DATABASE_AWAY
from services.core.loop import stop_if_cancelled, wait_set

log = structlog.get_logger(__name__)

LEASE_SECONDS = 5.0
RENEW_INTERVAL = 1.5
SWEEP_INTERVAL = 0.5

_ATTACH = """
    INSERT INTO run_attachments (run_id, replica_id, grace_seconds, expires_at)
    SELECT %(run_id)s, %(replica_id)s, coalesce(%(grace)s::float8, max(grace_seconds)),
           clock_timestamp() + make_interval(secs => %(lease)s::float8)
    FROM run_attachments WHERE run_id = %(run_id)s
    HAVING %(grace)s::float8 IS NOT NULL OR count(*) > 0
    ON CONFLICT (run_id, replica_id) DO UPDATE SET expires_at = excluded.expires_at
"""
_RENEW = """
    UPDATE run_attachments SET expires_at = clock_timestamp() + make_interval(secs => %s::float8)
    WHERE replica_id = %s AND run_id = ANY(%s)
"""
_EXPIRE = """
    UPDATE run_attachments SET expires_at = least(expires_at, clock_timestamp())
    WHERE replica_id = %s AND run_id = %s
"""
# The runs abandoned now, and the seconds until the next can be; rows of ended runs go.
_SWEEP = """
    WITH forgotten AS (
        DELETE FROM run_attachments a USING runs r
        WHERE r.run_id = a.run_id AND r.state NOT IN ('queued', 'prefill', 'streaming')
    ), live AS (
        SELECT a.run_id, extract(epoch FROM max(
            a.expires_at + make_interval(secs => a.grace_seconds)) - clock_timestamp()
        ) AS seconds_left
        FROM run_attachments a JOIN runs r ON r.run_id = a.run_id
        WHERE r.state IN ('queued', 'prefill', 'streaming')
        GROUP BY a.run_id
    )
    SELECT coalesce(array_agg(run_id) FILTER (WHERE seconds_left < 0), '{}') AS abandoned,
           min(seconds_left) FILTER (WHERE seconds_left >= 0)::float8 AS next_in
    FROM live
"""


async def attach_in(
    conn: AsyncConnection,
    run_id: str,
    replica_id: str,
    grace: float | None = None,
    lease: float = LEASE_SECONDS,
) -> None:
    """Takes or renews `replica_id`'s lease on `run_id`; `grace` is the run's disconnect
    grace when it is new, else the grace its other leases carry (a run without any, from
    before leases, is never abandoned)."""
    params = {"run_id": run_id, "replica_id": replica_id, "grace": grace, "lease": lease}
    async with driver_cursor(conn) as cursor:
        await cursor.execute(_ATTACH, params)


class Attachments:
    def __init__(
        self,
        db: Database,
        replica_id: str | None = None,
        *,
        lease: float = LEASE_SECONDS,
        renew_interval: float = RENEW_INTERVAL,
        sweep_interval: float = SWEEP_INTERVAL,
    ) -> None:
        self.db = db
        self.replica_id = replica_id or f"admission-{uuid.uuid4().hex[:12]}"
        self.lease = lease
        self.renew_interval = renew_interval
        self.sweep_interval = sweep_interval
        self._streams: Counter[str] = Counter()
        self._expiring: set[asyncio.Task[None]] = set()
        # Set when a stream of this replica ends: its run may be abandoned a grace later.
        self._detached = asyncio.Event()

    @contextlib.asynccontextmanager
    async def attached(self, run_id: str, *, leased: bool = False) -> AsyncIterator[None]:
        """Holds this replica's lease on `run_id` while the block runs; `leased` when the
        lease was just taken with the run's admission (`attach_in`)."""
        if self._streams[run_id] == 0 and not leased:
            async with single_statement(self.db) as conn:
                await attach_in(conn, run_id, self.replica_id, lease=self.lease)
        self._streams[run_id] += 1
        try:
            yield
        finally:
            self._detach(run_id)

    def _detach(self, run_id: str) -> None:
        # Synchronous up to the write: a generator closed late still counts its stream out.
        self._streams[run_id] -= 1
        if self._streams[run_id] > 0:
            return
        del self._streams[run_id]
        task = asyncio.get_running_loop().create_task(self._expire(run_id))
        self._expiring.add(task)
        task.add_done_callback(self._expiring.discard)

    async def _expire(self, run_id: str) -> None:
        if run_id in self._streams:
            return  # attached again meanwhile
        with contextlib.suppress(*DATABASE_AWAY):  # the lease then runs out by itself
            async with single_statement(self.db) as conn, driver_cursor(conn) as cursor:
                await cursor.execute(_EXPIRE, (self.replica_id, run_id))
        self._detached.set()

    async def run(self, on_abandoned: Callable[[str], Awaitable[None]]) -> None:
        """Renews this replica's leases and sweeps for abandoned runs until cancelled;
        `on_abandoned` is awaited for each, one at a time. The two loops are apart, so a
        slow cancel never holds back a renewal (other replicas would take a run whose
        lease lapsed for abandoned)."""
        await asyncio.gather(self._renew_leases(), self._sweep(on_abandoned))

    async def _renew_leases(self) -> None:
        while True:
            stop_if_cancelled()
            if self._streams:
                try:
                    await self._renew()
                except DATABASE_AWAY as error:
                    log.warning("attachments unavailable", error=type(error).__name__)
            await asyncio.sleep(self.renew_interval)

    async def _sweep(self, on_abandoned: Callable[[str], Awaitable[None]]) -> None:
        while True:
            stop_if_cancelled()
            self._detached.clear()
            wait = self.lease
            try:
                abandoned, next_in = await self._abandoned()
                for run_id in abandoned:
                    await on_abandoned(run_id)
                if next_in is not None:
                    wait = min(wait, next_in)
            except DATABASE_AWAY as error:
                log.warning("abandoned runs not swept", error=type(error).__name__)
            await asyncio.sleep(self.sweep_interval)
            await wait_set(self._detached, wait - self.sweep_interval)

    async def aclose(self) -> None:
        await asyncio.gather(*self._expiring, return_exceptions=True)

    async def _renew(self) -> None:
        async with single_statement(self.db) as conn, driver_cursor(conn) as cursor:
            await cursor.execute(_RENEW, (self.lease, self.replica_id, list(self._streams)))

    async def _abandoned(self) -> tuple[list[str], float | None]:
        """The runs abandoned now, and the seconds until the next can be (None: none)."""
        async with single_statement(self.db) as conn, driver_cursor(conn) as cursor:
            await cursor.execute(_SWEEP)
            row = await cursor.fetchone()
        assert row is not None
        return list(row["abandoned"]), row["next_in"]
