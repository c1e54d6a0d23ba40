"""The demo key `tollgate up` hands out: one valid at a time, however often it starts."""

from collections.abc import AsyncIterator

import pytest

from services.admission.key_store import KeyScopes, KeyStore
from services.admission.tenant_store import TenantStore
from services.core.auth import authenticate
from services.core.db import Database, open_db
from services.core.errors import Unauthenticated
from services.stack.bootstrap import DEMO_TENANT, demo_key


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[Database]:
    db = open_db(database_url, pool_size=2)
    yield db
    await db.dispose()


async def tenant_of(db: Database, secret: str) -> str:
    principal = await authenticate(db, [("authorization", f"Bearer {secret}")])
    assert principal.tenant_id is not None
    return principal.tenant_id


async def test_each_demo_key_revokes_the_ones_before_it(db: Database) -> None:
    first = await demo_key(db)
    tenant_id = await tenant_of(db, first.secret)
    # One an earlier version minted (no alias), and one an admin made on purpose.
    older = await KeyStore(db).create(tenant_id)
    own = await KeyStore(db).create(tenant_id, KeyScopes(alias="my script"))

    second = await demo_key(db)

    assert second.tenant_id == tenant_id and second.secret != first.secret
    assert await tenant_of(db, second.secret) == tenant_id
    for revoked in (first, older):
        with pytest.raises(Unauthenticated):
            await tenant_of(db, revoked.secret)
    assert await tenant_of(db, own.secret) == tenant_id
    keys, _ = await KeyStore(db).list(tenant_id, 100, "")
    assert {key.key_id for key in keys if not key.revoked} == {second.key_id, own.key_id}


async def test_the_demo_tenant_is_made_once(db: Database) -> None:
    await demo_key(db)
    await demo_key(db)
    names = [tenant.name for tenant in await TenantStore(db).list()]
    assert names.count(DEMO_TENANT) == 1
