from datetime import UTC, datetime, timedelta

import sqlalchemy as sa

from services.admission.key_store import KeyStore
from services.admission.tenant_store import TenantStore
from services.core.auth import authenticate
from services.core.db import Database
from services.core.key_usage import KeyUsage


async def row_version(db: Database, key_id: str) -> tuple[str, datetime | None]:
    """The key row's xmin (a new one for each write of the row) and its last use."""
    query = sa.text("SELECT xmin::text AS xmin, last_used_at FROM api_keys WHERE key_id = :k")
    async with db.connect() as conn:
        row = (await conn.execute(query, {"k": key_id})).one()
    return row.xmin, row.last_used_at


async def test_uses_are_written_in_one_statement_per_flush(db: Database) -> None:
    tenant = await TenantStore(db).create("acme", 1)
    keys = [await KeyStore(db).create(tenant.tenant_id) for _ in range(2)]
    moments = iter(datetime(2030, 1, 1, tzinfo=UTC) + timedelta(seconds=n) for n in range(10))
    usage = KeyUsage(clock=lambda: next(moments))
    written = await row_version(db, keys[0].key_id)
    for key in (keys[0], keys[0], keys[1]):
        metadata = [("authorization", f"Bearer {key.secret}")]
        principal = await authenticate(db, metadata, usage=usage)
        assert principal.key_id == key.key_id
    # Two uses of the first key, none written yet.
    assert await row_version(db, keys[0].key_id) == written and usage.num_pending == 2
    assert await usage.flush(db) == 2
    xmin, last_used = await row_version(db, keys[0].key_id)
    assert xmin != written[0] and last_used == datetime(2030, 1, 1, 0, 0, 1, tzinfo=UTC)
    assert (await row_version(db, keys[1].key_id))[1] == datetime(2030, 1, 1, 0, 0, 2, tzinfo=UTC)
    assert await usage.flush(db) == 0
    assert await row_version(db, keys[0].key_id) == (xmin, last_used)


async def test_a_flush_never_moves_a_last_use_back(db: Database) -> None:
    tenant = await TenantStore(db).create("acme", 1)
    key = await KeyStore(db).create(tenant.tenant_id)
    late, early = datetime(2030, 1, 2, tzinfo=UTC), datetime(2030, 1, 1, tzinfo=UTC)
    for moment in (late, early):  # two replicas, the one that saw the later use first
        usage = KeyUsage(clock=lambda moment=moment: moment)  # type: ignore[misc]
        usage.used(key.key_id)
        await usage.flush(db)
    assert (await row_version(db, key.key_id))[1] == late
