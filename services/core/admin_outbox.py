"""The outbox relay's admin events: outbox rows that name an `admin_events` row, published
to the admin topic by the relay that publishes run events, in its pass, on its connection.

They follow the run events' rules: published in outbox id order (a tenant's changes
serialize on its row, so its ids increase in commit order), marked once acknowledged and
kept for the republish window, published again with the rest when the broker lost what it
acknowledged (as told by the run events' topic, which shares its broker). One the producer refuses `max_attempts` times leaves the outbox and is
logged; its `admin_events` row stays, and `INSERT INTO outbox (admin_event_id) ...` puts
it back.
"""

from __future__ import annotations

from collections.abc import Mapping

import psycopg
import structlog
from prometheus_client import Counter
from psycopg.rows import dict_row

from services.core.audit import AdminEvent, event_from_row, to_record
from services.core.kafka import Placed, Publisher

log = structlog.get_logger(__name__)

ADMIN_PUBLISHED = Counter(
    "tollgate_relay_admin_events_published", "Admin events the relay published to Kafka"
)

_FETCH = """
    SELECT o.id AS outbox_id, a.event_id, a.type, a.tenant_id, a.subject, a.actor, a.before,
           a.after, a.created_at
    FROM outbox o JOIN admin_events a ON a.event_id = o.admin_event_id
    WHERE o.published_at IS NULL
    ORDER BY o.id
    LIMIT %s
"""


async def fetch_admin_batch(
    conn: psycopg.AsyncConnection, limit: int
) -> list[tuple[int, AdminEvent]]:
    """Unpublished admin events, oldest first, with their outbox ids."""
    async with conn.cursor(row_factory=dict_row) as cursor:
        await cursor.execute(_FETCH, (limit,))
        rows = await cursor.fetchall()
    return [(row["outbox_id"], event_from_row(row)) for row in rows]


async def publish_admin_batch(
    publisher: Publisher, topic: str, batch: list[tuple[int, AdminEvent]]
) -> tuple[dict[int, Placed], dict[int, str]]:
    """Publishes `batch` to `topic`: where the broker put each event it acknowledged, and
    why each other was refused, by outbox id."""
    results = await publisher.send(topic, [to_record(event) for _, event in batch])
    placed: dict[int, Placed] = {}
    refused: dict[int, str] = {}
    for (outbox_id, _), result in zip(batch, results, strict=True):
        if isinstance(result, Placed):
            placed[outbox_id] = result
        else:
            refused[outbox_id] = result
    ADMIN_PUBLISHED.inc(len(placed))
    return placed, refused


async def drop_refused(conn: psycopg.AsyncConnection, refused: Mapping[int, str]) -> None:
    """Takes the outbox rows (by id) of admin events refused for good out of the outbox."""
    if not refused:
        return
    await conn.execute("DELETE FROM outbox WHERE id = ANY(%s)", (list(refused),))
    for outbox_id, error in refused.items():
        log.error("admin event left out of the outbox", outbox_id=outbox_id, error=error)
