"""The demo tenant and API key `tollgate up` hands out."""

from __future__ import annotations

from services.admission.tenant_store import KeyRecord, TenantStore
from services.core.db import Database

DEMO_TENANT = "demo"


async def demo_key(db: Database) -> KeyRecord:
    """A new key of the demo tenant, creating the tenant on first use."""
    tenants = TenantStore(db)
    tenant = await tenants.find_by_name(DEMO_TENANT) or await tenants.create(DEMO_TENANT, 1)
    return await tenants.create_key(tenant.tenant_id)
