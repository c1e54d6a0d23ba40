"""The demo tenant and API key `tollgate up` hands out.

Each start mints a new key and revokes the ones earlier starts minted, so that a data
directory holds one valid demo key at most: the one its stack.json names.
"""

from __future__ import annotations

from services.admission.key_store import KeyRecord, KeyScopes, KeyStore
from services.admission.tenant_store import TenantStore
from services.core.db import Database

DEMO_TENANT = "demo"
DEMO_KEY_ALIAS = "tollgate up"
# Keys with no alias: those of versions that minted them without one.
MINTED_ALIASES = (DEMO_KEY_ALIAS, "")
PAGE_SIZE = 500


async def demo_key(db: Database) -> KeyRecord:
    """A new key of the demo tenant, creating the tenant on first use; the keys earlier
    calls made are revoked (the tenant's keys of other aliases are left alone)."""
    tenants = TenantStore(db)
    tenant = await tenants.find_by_name(DEMO_TENANT) or await tenants.create(DEMO_TENANT, 1)
    keys = KeyStore(db)
    for key in await _keys_of(keys, tenant.tenant_id):
        if not key.revoked and key.scopes.alias in MINTED_ALIASES:
            await keys.revoke(key.key_id)
    return await keys.create(tenant.tenant_id, KeyScopes(alias=DEMO_KEY_ALIAS))


async def _keys_of(keys: KeyStore, tenant_id: str) -> list[KeyRecord]:
    found, token = await keys.list(tenant_id, PAGE_SIZE, "")
    while token:
        page, token = await keys.list(tenant_id, PAGE_SIZE, token)
        found.extend(page)
    return found
