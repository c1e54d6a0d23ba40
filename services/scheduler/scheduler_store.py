"""The scheduler's reads of the `runs` projection and its conditional lease."""

from __future__ import annotations

from collections.abc import Collection

import sqlalchemy as sa

from services.core.db import Database, driver_cursor, single_statement
from services.core.runs import RunState
from services.core.schema import run_events, runs, tenants
from services.scheduler.records import QueuedRun, RunStatus, queued_run

ACTIVE_STATES = (str(RunState.PREFILL), str(RunState.STREAMING))


# A lease for a run still queued at the seq and lease epoch the scheduler knows; the run's
# row as it is after. The epoch it moves is the fence: of two leases from one reading, the
# second finds the epoch changed.
_LEASE_IF_QUEUED = """
    UPDATE runs SET lease_epoch = lease_epoch + 1, owner = %s
    WHERE run_id = %s AND state = %s AND last_seq = %s AND lease_epoch = %s
    RETURNING lease_epoch, last_seq
"""


class SchedulerStore:
    def __init__(self, db: Database, block_size: int = 16) -> None:
        self.db = db
        self.block_size = block_size

    async def queued_run_ids(self) -> list[str]:
        """Every run in state `queued`, oldest first."""
        query = (
            sa.select(runs.c.run_id)
            .where(runs.c.state == str(RunState.QUEUED))
            .order_by(runs.c.created_at)
        )
        async with single_statement(self.db) as conn:
            return list((await conn.scalars(query)).all())

    async def load_queued(self, run_ids: Collection[str]) -> list[QueuedRun]:
        """Those of `run_ids` still in state `queued`, with their latest `queued` event."""
        if not run_ids:
            return []
        latest = (
            sa.select(
                run_events.c.payload,
                run_events.c.traceparent,
                run_events.c.created_at.label("queued_at"),
            )
            .where(run_events.c.run_id == runs.c.run_id, run_events.c.kind == str(RunState.QUEUED))
            .order_by(run_events.c.seq.desc())
            .limit(1)
            .lateral("latest")
        )
        query = (
            sa.select(
                runs.c.run_id,
                runs.c.tenant_id,
                runs.c.model,
                runs.c.priority,
                runs.c.last_seq,
                runs.c.lease_epoch,
                runs.c.created_at,
                sa.func.coalesce(tenants.c.weight, 1).label("weight"),
                latest.c.payload,
                latest.c.traceparent,
                latest.c.queued_at,
            )
            .select_from(
                runs.join(latest, sa.true()).outerjoin(
                    tenants, tenants.c.tenant_id == runs.c.tenant_id
                )
            )
            .where(runs.c.state == str(RunState.QUEUED), runs.c.run_id.in_(list(run_ids)))
            .order_by(runs.c.created_at)
        )
        async with single_statement(self.db) as conn:
            return [self._queued_run(row._mapping) for row in await conn.execute(query)]

    def _queued_run(self, row: sa.RowMapping) -> QueuedRun:
        return queued_run(
            run_id=row["run_id"],
            tenant_id=row["tenant_id"],
            model=row["model"],
            priority=row["priority"],
            last_seq=row["last_seq"],
            payload=row["payload"],
            traceparent=row["traceparent"],
            created_at=row["created_at"].timestamp(),
            queued_at=row["queued_at"].timestamp(),
            weight=row["weight"],
            block_size=self.block_size,
            lease_epoch=row["lease_epoch"],
        )

    async def lease_if_queued(
        self, run_id: str, owner: str, last_seq: int, lease_epoch: int
    ) -> tuple[int, int] | None:
        """acquire_lease for a run still queued at `last_seq` and `lease_epoch`:
        (lease_epoch, last_seq) after, or None.

        The guard keeps a run that ended meanwhile (a cancel) from being handed out, one
        queued again since (its worker was lost) from going out with stale details, and
        one leased since (by another scheduler) from being leased twice.
        """
        parameters = (owner, run_id, str(RunState.QUEUED), last_seq, lease_epoch)
        async with single_statement(self.db) as conn, driver_cursor(conn) as cursor:
            await cursor.execute(_LEASE_IF_QUEUED, parameters)
            row = await cursor.fetchone()
        return (int(row["lease_epoch"]), int(row["last_seq"])) if row else None

    async def statuses(self, run_ids: Collection[str]) -> dict[str, RunStatus]:
        if not run_ids:
            return {}
        return await self._statuses(runs.c.run_id.in_(list(run_ids)))

    async def active_runs(self) -> dict[str, RunStatus]:
        """Runs a worker has started (prefill, streaming)."""
        return await self._statuses(runs.c.state.in_(ACTIVE_STATES))

    async def _statuses(self, condition: sa.ColumnElement[bool]) -> dict[str, RunStatus]:
        query = sa.select(
            runs.c.run_id,
            runs.c.tenant_id,
            runs.c.state,
            runs.c.owner,
            runs.c.lease_epoch,
            runs.c.last_seq,
        ).where(condition)
        async with single_statement(self.db) as conn:
            rows = (await conn.execute(query)).all()
        return {
            row.run_id: RunStatus(
                run_id=row.run_id,
                tenant_id=row.tenant_id,
                state=RunState(row.state),
                owner=row.owner,
                lease_epoch=int(row.lease_epoch),
                last_seq=int(row.last_seq),
            )
            for row in rows
        }
