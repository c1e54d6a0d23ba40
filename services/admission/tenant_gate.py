"""How many of one tenant's runs this replica admits at once.

Admitting a run holds one of the replica's database connections for its transaction
and a thread to tokenize its prompt: a tenant that sends hundreds of requests at once
would otherwise hold them all, and every other tenant's first token would wait for a
connection behind that tenant's backlog. Past `per_tenant` admissions in progress, a
tenant's next waits for one of its own to end; other tenants' go straight on.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

DEFAULT_ADMISSIONS_PER_TENANT = 4


class TenantGate:
    def __init__(self, per_tenant: int = DEFAULT_ADMISSIONS_PER_TENANT) -> None:
        self.per_tenant = per_tenant
        # tenant -> its semaphore and how many hold or wait for it; gone at zero
        self._gates: dict[str, tuple[asyncio.Semaphore, int]] = {}

    @contextlib.asynccontextmanager
    async def admitting(self, tenant_id: str) -> AsyncIterator[None]:
        """Holds one of the tenant's admission places while the block runs."""
        if self.per_tenant <= 0:
            yield
            return
        gate, users = self._gates.get(tenant_id, (asyncio.Semaphore(self.per_tenant), 0))
        self._gates[tenant_id] = (gate, users + 1)
        try:
            async with gate:
                yield
        finally:
            gate, users = self._gates[tenant_id]
            if users == 1:
                del self._gates[tenant_id]
            else:
                self._gates[tenant_id] = (gate, users - 1)

    def waiting(self, tenant_id: str) -> int:
        """The tenant's admissions in progress and waiting here."""
        return self._gates.get(tenant_id, (None, 0))[1]
