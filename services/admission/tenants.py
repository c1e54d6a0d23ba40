"""Tenants, API keys and quotas in PostgreSQL.

A tenant made here is born with a finite `max_concurrent_runs`
(`default_max_concurrent_runs`, TOLLGATE_DEFAULT_MAX_CONCURRENT_RUNS in admission), so a
key that leaks before anyone sets a quota cannot fill the queue alone; SetQuota with 0
lifts it.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from services.core.auth import new_key
from services.core.db import Database, single_statement
from services.core.errors import FailedPrecondition, NotFound
from services.core.schema import api_keys, tenants
from services.core.validation import is_identifier, shown

DEFAULT_MAX_CONCURRENT_RUNS = 64


@dataclass(frozen=True, slots=True)
class TenantRecord:
    tenant_id: str
    name: str
    weight: int
    max_kv_blocks: int
    max_concurrent_runs: int
    max_concurrent_streams: int | None = None  # None: admission's default


@dataclass(frozen=True, slots=True)
class KeyRecord:
    key_id: str
    tenant_id: str
    secret: str  # empty except right after creation
    revoked: bool


class TenantRepository:
    def __init__(
        self, db: Database, default_max_concurrent_runs: int = DEFAULT_MAX_CONCURRENT_RUNS
    ) -> None:
        """`default_max_concurrent_runs` is the limit new tenants start with; 0 = none."""
        self.db = db
        self.default_max_concurrent_runs = default_max_concurrent_runs

    async def create(self, name: str, weight: int) -> TenantRecord:
        tenant_id = f"ten_{secrets.token_hex(8)}"
        try:
            async with self.db.begin() as conn:
                await conn.execute(
                    tenants.insert().values(
                        tenant_id=tenant_id,
                        name=name,
                        weight=weight,
                        max_concurrent_runs=self.default_max_concurrent_runs,
                        created_at=sa.func.clock_timestamp(),
                    )
                )
        except IntegrityError:
            raise FailedPrecondition(
                f"a tenant named {shown(name)} exists", "TENANT_EXISTS"
            ) from None
        return await self.get(tenant_id)

    async def get(self, tenant_id: str) -> TenantRecord:
        _require_id("tenant", tenant_id)
        async with single_statement(self.db) as conn:
            row = (
                await conn.execute(sa.select(tenants).where(tenants.c.tenant_id == tenant_id))
            ).first()
        if row is None:
            raise NotFound(f"tenant {tenant_id} does not exist")
        return _tenant(row._mapping)

    async def find_by_name(self, name: str) -> TenantRecord | None:
        async with single_statement(self.db) as conn:
            row = (await conn.execute(sa.select(tenants).where(tenants.c.name == name))).first()
        return _tenant(row._mapping) if row else None

    async def list(self) -> list[TenantRecord]:
        async with single_statement(self.db) as conn:
            rows = await conn.execute(sa.select(tenants).order_by(tenants.c.created_at))
        return [_tenant(row._mapping) for row in rows]

    async def set_quota(
        self,
        tenant_id: str,
        max_kv_blocks: int,
        max_concurrent_runs: int,
        max_concurrent_streams: int | None = None,
    ) -> TenantRecord:
        """Replaces the tenant's limits; `max_concurrent_streams` None is the default."""
        _require_id("tenant", tenant_id)
        async with self.db.begin() as conn:
            updated = await conn.execute(
                tenants.update()
                .where(tenants.c.tenant_id == tenant_id)
                .values(
                    max_kv_blocks=max_kv_blocks,
                    max_concurrent_runs=max_concurrent_runs,
                    max_concurrent_streams=max_concurrent_streams,
                )
            )
        if updated.rowcount == 0:
            raise NotFound(f"tenant {tenant_id} does not exist")
        return await self.get(tenant_id)

    async def create_key(self, tenant_id: str) -> KeyRecord:
        await self.get(tenant_id)
        key = new_key()
        async with self.db.begin() as conn:
            await conn.execute(
                api_keys.insert().values(
                    key_id=key.key_id,
                    tenant_id=tenant_id,
                    secret_hash=key.secret_hash,
                    created_at=sa.func.clock_timestamp(),
                )
            )
        return KeyRecord(key.key_id, tenant_id, key.secret, revoked=False)

    async def revoke_key(self, key_id: str) -> KeyRecord:
        _require_id("API key", key_id)
        async with self.db.begin() as conn:
            row = (
                await conn.execute(
                    api_keys.update()
                    .where(api_keys.c.key_id == key_id)
                    .values(
                        revoked_at=sa.func.coalesce(
                            api_keys.c.revoked_at, sa.func.clock_timestamp()
                        )
                    )
                    .returning(api_keys.c.tenant_id)
                )
            ).first()
        if row is None:
            raise NotFound(f"API key {key_id} does not exist")
        return KeyRecord(key_id, row.tenant_id, "", revoked=True)


def _require_id(kind: str, value: str) -> None:
    """What is not an id names nothing; checked before it reaches SQL."""
    if not is_identifier(value):
        raise NotFound(f"{kind} {shown(value)} does not exist")


def _tenant(row: Mapping[Any, Any]) -> TenantRecord:
    return TenantRecord(
        tenant_id=row["tenant_id"],
        name=row["name"],
        weight=row["weight"],
        max_kv_blocks=row["max_kv_blocks"],
        max_concurrent_runs=row["max_concurrent_runs"],
        max_concurrent_streams=row["max_concurrent_streams"],
    )
