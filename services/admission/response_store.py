"""What a Responses API response keeps beyond its run's events (the `responses` table):
written once its run is admitted, read by its tenant until it is deleted or its
retention is over.

The row is written right after `Gateway.start` returns, not in the admission's own
transaction: admitting is shared by every front door (gRPC, chat completions), and its
transaction holds the tenant's row lock, which this row has no need of. A process that
dies between the two leaves a run without a response, which reads as one that does not
exist; the same request again with its `Idempotency-Key` finds the run and writes the row
then (a row already there is kept as it was).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert

from services.core.db import Database, single_statement
from services.core.schema import responses


@dataclass(frozen=True, slots=True)
class ResponseRecord:
    """A response's request as the Response object echoes it (`request`), its input items
    as sent, with their ids (`input_items`), and the whole conversation its run was given,
    instructions aside (`conversation`, chat turns in JSON, which a next turn builds on)."""

    run_id: str
    tenant_id: str
    request: Mapping[str, Any]
    input_items: Sequence[Mapping[str, Any]] = ()
    conversation: Sequence[Mapping[str, Any]] = ()
    created_at: datetime | None = None
    deleted_at: datetime | None = None

    @property
    def stored(self) -> bool:
        return self.request.get("store") is not False

    @property
    def background(self) -> bool:
        return bool(self.request.get("background"))


async def save_response(db: Database, record: ResponseRecord) -> None:
    """Stores `record` unless its run has one already."""
    statement = (
        insert(responses)
        .values(
            run_id=record.run_id,
            tenant_id=record.tenant_id,
            request=dict(record.request),
            input_items=[dict(item) for item in record.input_items],
            conversation=[dict(turn) for turn in record.conversation],
            created_at=sa.func.now(),
        )
        .on_conflict_do_nothing(index_elements=["run_id"])
    )
    async with single_statement(db) as conn:
        await conn.execute(statement)


async def find_response(
    db: Database, tenant_id: str, run_id: str, retention_seconds: float
) -> ResponseRecord | None:
    """The tenant's response, unless it was deleted or is older than the retention."""
    kept_since = sa.func.now() - sa.func.make_interval(0, 0, 0, 0, 0, 0, retention_seconds)
    query = sa.select(responses).where(
        responses.c.run_id == run_id,
        responses.c.tenant_id == tenant_id,
        responses.c.deleted_at.is_(None),
        responses.c.created_at > kept_since,
    )
    async with single_statement(db) as conn:
        row = (await conn.execute(query)).first()
    if row is None:
        return None
    return ResponseRecord(**row._mapping)


async def delete_response(db: Database, tenant_id: str, run_id: str) -> None:
    """Marks the tenant's response deleted (a deleted one stays so)."""
    statement = (
        sa.update(responses)
        .where(
            responses.c.run_id == run_id,
            responses.c.tenant_id == tenant_id,
            responses.c.deleted_at.is_(None),
        )
        .values(deleted_at=sa.func.now())
    )
    async with single_statement(db) as conn:
        await conn.execute(statement)
