"""Tenants and quotas in PostgreSQL (API keys: key_store.py); each change recorded as an admin
audit event in its own transaction (services.core.audit).

A tenant made here is born with a finite `max_concurrent_runs`
(`default_max_concurrent_runs`, TOLLGATE_DEFAULT_MAX_CONCURRENT_RUNS in admission), so a
key that leaks before anyone sets a quota cannot fill the queue alone; SetQuota with 0
lifts it.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from services.admission.key_store import KeyRecord, KeyStore
from services.core import audit
from services.core.db import Database, single_statement
from services.core.errors import FailedPrecondition, NotFound
from services.core.quota_store import RATE_FIELDS, key_subject, recount_budget, tenant_subject
from services.core.quotas import QuotaLimits
from services.core.schema import api_keys, key_quotas, tenants
from services.core.validation import require_id, shown

DEFAULT_MAX_CONCURRENT_RUNS = 64
NO_LIMITS = QuotaLimits()


@dataclass(frozen=True, slots=True)
class KeyQuota:
    key_id: str
    tenant_id: str
    limits: QuotaLimits


@dataclass(frozen=True, slots=True)
class TenantRecord:
    tenant_id: str
    name: str
    weight: int
    max_kv_blocks: int
    max_concurrent_runs: int
    max_concurrent_streams: int | None = None  # None: admission's default
    # The rate and budget limits (its max_* mirror the two above).
    limits: QuotaLimits = NO_LIMITS
    key_quotas: tuple[KeyQuota, ...] = ()


class TenantStore:
    def __init__(
        self, db: Database, default_max_concurrent_runs: int = DEFAULT_MAX_CONCURRENT_RUNS
    ) -> None:
        """`default_max_concurrent_runs` is the limit new tenants start with; 0 = none."""
        self.db = db
        self.default_max_concurrent_runs = default_max_concurrent_runs

    async def create(self, name: str, weight: int, actor: str = audit.ADMIN_ACTOR) -> TenantRecord:
        tenant_id = f"ten_{secrets.token_hex(8)}"
        try:
            async with self.db.begin() as conn:
                created = await conn.execute(
                    tenants.insert()
                    .values(
                        tenant_id=tenant_id,
                        name=name,
                        weight=weight,
                        max_concurrent_runs=self.default_max_concurrent_runs,
                        created_at=sa.func.clock_timestamp(),
                    )
                    .returning(*tenants.c)
                )
                after = created.one()._mapping
                await _audit(conn, "tenant.created", actor, None, after)
        except IntegrityError:
            raise FailedPrecondition(
                f"a tenant named {shown(name)} exists", "TENANT_EXISTS"
            ) from None
        return await self.get(tenant_id)

    async def get(self, tenant_id: str) -> TenantRecord:
        require_id("tenant", tenant_id)
        async with self.db.connect() as conn:
            row = (
                await conn.execute(sa.select(tenants).where(tenants.c.tenant_id == tenant_id))
            ).first()
            keys = await conn.execute(
                sa.select(key_quotas)
                .where(key_quotas.c.tenant_id == tenant_id)
                .order_by(key_quotas.c.key_id)
            )
        if row is None:
            raise NotFound(f"tenant {tenant_id} does not exist")
        found = [KeyQuota(k.key_id, k.tenant_id, _limits(k._mapping)) for k in keys]
        return replace(_tenant(row._mapping), key_quotas=tuple(found))

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
        rates: QuotaLimits = NO_LIMITS,
        actor: str = audit.ADMIN_ACTOR,
    ) -> TenantRecord:
        """Replaces the tenant's limits (the rate and budget ones from `rates`);
        `max_concurrent_streams` None is the default. A budget starts at what the tenant
        spent in the period so far (quota_store.recount_budget)."""
        require_id("tenant", tenant_id)
        async with self.db.begin() as conn:
            locked = sa.select(tenants).where(tenants.c.tenant_id == tenant_id).with_for_update()
            before = (await conn.execute(locked)).first()
            if before is None:
                raise NotFound(f"tenant {tenant_id} does not exist")
            updated = await conn.execute(
                tenants.update()
                .where(tenants.c.tenant_id == tenant_id)
                .values(
                    max_kv_blocks=max_kv_blocks,
                    max_concurrent_runs=max_concurrent_runs,
                    max_concurrent_streams=max_concurrent_streams,
                    **_rate_values(rates),
                )
                .returning(*tenants.c)
            )
            after = updated.one()._mapping
            if rates.budget_micros:
                await recount_budget(conn, tenant_subject(tenant_id, rates))
            await _audit(conn, "quota.set", actor, before._mapping, after)
        return await self.get(tenant_id)

    async def set_key_quota(
        self, tenant_id: str, key_id: str, limits: QuotaLimits, actor: str = audit.ADMIN_ACTOR
    ) -> KeyQuota:
        """Replaces the limits of one of the tenant's keys (applied with the tenant's); a
        budget starts at what the key's runs spent in the period so far."""
        require_id("API key", key_id)
        async with self.db.begin() as conn:
            owner = (
                await conn.execute(
                    sa.select(api_keys.c.tenant_id).where(api_keys.c.key_id == key_id)
                )
            ).scalar()
            if owner is None or (tenant_id and owner != tenant_id):
                raise NotFound(f"API key {key_id} of tenant {shown(tenant_id)} does not exist")
            # The lock every admission of the tenant's keys takes: none reads the key's
            # limits, or charges its budget, between the recount and the commit.
            await conn.execute(
                sa.select(tenants.c.tenant_id).where(tenants.c.tenant_id == owner).with_for_update()
            )
            before = (
                await conn.execute(
                    sa.select(key_quotas).where(key_quotas.c.key_id == key_id).with_for_update()
                )
            ).first()
            values = {
                **_rate_values(limits),
                "max_concurrent_runs": limits.max_concurrent_runs,
                "max_kv_blocks": limits.max_kv_blocks,
            }
            after = (
                await conn.execute(
                    pg_insert(key_quotas)
                    .values(key_id=key_id, tenant_id=owner, **values)
                    .on_conflict_do_update(index_elements=[key_quotas.c.key_id], set_=values)
                    .returning(*key_quotas.c)
                )
            ).one()
            if limits.budget_micros:
                await recount_budget(conn, key_subject(key_id, limits))
            await _audit(
                conn,
                "key_quota.set",
                actor,
                before._mapping if before is not None else None,
                after._mapping,
                subject=key_id,
            )
        return KeyQuota(key_id, owner, limits)

    async def create_key(self, tenant_id: str) -> KeyRecord:
        """A key of every scope (KeyStore.create sets scopes)."""
        return await KeyStore(self.db).create(tenant_id)


async def _audit(
    conn: AsyncConnection,
    kind: str,
    actor: str,
    before: Mapping[Any, Any] | None,
    after: Mapping[Any, Any],
    subject: str = "",
) -> None:
    """Records a change of a tenant's row (or, given `subject`, of that key's quota row)."""
    change = audit.AdminChange(
        type=kind,
        tenant_id=after["tenant_id"],
        subject=subject or after["tenant_id"],
        actor=actor,
        before=_audit_view(before) if before is not None else None,
        after=_audit_view(after),
    )
    await audit.record(conn, change)


def _audit_view(row: Mapping[Any, Any]) -> dict[str, Any]:
    """Every column of a tenant's row but its creation time: its name, weight and limits."""
    return audit.jsonable({str(name): value for name, value in row.items() if name != "created_at"})


def _tenant(row: Mapping[Any, Any]) -> TenantRecord:
    return TenantRecord(
        tenant_id=row["tenant_id"],
        name=row["name"],
        weight=row["weight"],
        max_kv_blocks=row["max_kv_blocks"],
        max_concurrent_runs=row["max_concurrent_runs"],
        max_concurrent_streams=row["max_concurrent_streams"],
        limits=_limits(row),
    )


def _limits(row: Mapping[Any, Any]) -> QuotaLimits:
    return QuotaLimits(
        **{name: row[name] for name in RATE_FIELDS},
        max_concurrent_runs=row["max_concurrent_runs"],
        max_kv_blocks=row["max_kv_blocks"],
    )


def _rate_values(limits: QuotaLimits) -> dict[str, Any]:
    return {name: getattr(limits, name) for name in RATE_FIELDS}
