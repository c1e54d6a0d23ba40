"""Admin audit events: every change to a tenant, API key or quota, recorded in the
transaction that makes it, with an outbox row, so that the outbox relay publishes it to
`tollgate.admin-events.v1` as it does run events: never lost, at least once.

A record is a CloudEvent in binary mode like a run event's (`ce_*` headers), keyed by
tenant (a tenant's changes keep their order), whose data is JSON: `actor`, `before`,
`after` (null for what did not exist). `before` and `after` hold what the admin API shows
of the thing changed: never a secret or its hash.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import date, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from services.core.codec import rfc3339
from services.core.db import ADMIN_EVENTS_CHANNEL
from services.core.kafka import Record

CE_SOURCE = "//tollgate/admin"
CONTENT_TYPE = "application/json"
ADMIN_ACTOR = "admin"

Snapshot = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class AdminChange:
    """One change, as its transaction records it. `type` reads `<thing>.<past tense>`
    (`tenant.created`, `api_key.rotated`, `quota.set`); `subject` is the id changed."""

    type: str
    tenant_id: str
    subject: str
    actor: str
    before: Snapshot | None
    after: Snapshot | None


@dataclass(frozen=True, slots=True)
class AdminEvent:
    event_id: str
    change: AdminChange
    created_at: datetime


_RECORD = sa.text(
    """
    WITH ev AS (
        INSERT INTO admin_events (event_id, type, tenant_id, subject, actor, before, after,
                                  created_at)
        VALUES (:event_id, :type, :tenant_id, :subject, :actor, CAST(:before AS jsonb),
                CAST(:after AS jsonb), clock_timestamp())
        RETURNING event_id
    ), ob AS (
        INSERT INTO outbox (admin_event_id) SELECT event_id FROM ev
    )
    SELECT pg_notify(:channel, '') FROM ev
    """
)


async def record(conn: AsyncConnection, change: AdminChange) -> str:
    """Records `change` in `conn`'s transaction (the one that makes it); returns its id."""
    event_id = f"adm_{secrets.token_hex(12)}"
    await conn.execute(
        _RECORD,
        {
            "event_id": event_id,
            "type": change.type,
            "tenant_id": change.tenant_id,
            "subject": change.subject,
            "actor": change.actor,
            "before": _json(change.before),
            "after": _json(change.after),
            "channel": ADMIN_EVENTS_CHANNEL,
        },
    )
    return event_id


def _json(snapshot: Snapshot | None) -> str | None:
    return None if snapshot is None else json.dumps(jsonable(snapshot))


def jsonable(snapshot: Snapshot) -> dict[str, Any]:
    """`snapshot` with its times as RFC 3339 text and its tuples as lists."""
    return {name: _plain(value) for name, value in snapshot.items()}


def _plain(value: Any) -> Any:
    if isinstance(value, datetime):
        return rfc3339(value)
    if isinstance(value, date):
        return value.isoformat()
    if isinstance(value, tuple | list | frozenset):
        return [_plain(v) for v in value]
    return value


def ce_type(change_type: str) -> str:
    return f"tollgate.admin.{change_type}.v1"


def to_record(event: AdminEvent) -> Record:
    """The Kafka record of `event`: CloudEvents binary mode, keyed by tenant."""
    change = event.change
    data = {"actor": change.actor, "before": change.before, "after": change.after}
    headers = [
        ("ce_specversion", b"1.0"),
        ("ce_id", event.event_id.encode()),
        ("ce_source", CE_SOURCE.encode()),
        ("ce_type", ce_type(change.type).encode()),
        ("ce_time", rfc3339(event.created_at).encode()),
        ("ce_subject", change.subject.encode()),
        ("content-type", CONTENT_TYPE.encode()),
    ]
    value = json.dumps(data, separators=(",", ":")).encode()
    return Record(change.tenant_id.encode(), value, headers)


def event_from_row(row: Mapping[str, Any]) -> AdminEvent:
    change = AdminChange(
        type=row["type"],
        tenant_id=row["tenant_id"],
        subject=row["subject"],
        actor=row["actor"],
        before=row["before"],
        after=row["after"],
    )
    return AdminEvent(row["event_id"], change, row["created_at"])
