"""API keys in PostgreSQL: create (with their scopes), list, rotate, revoke.

Each change is recorded as an admin audit event in its own transaction
(services.core.audit). A rotation keeps the key's id, alias and scopes and gives it a new
secret; the replaced one keeps working for the overlap the caller sets, then is refused.
Rotating again within an overlap ends the older secret's at once: a key has at most two.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from services.core import audit, paging
from services.core.auth import new_key
from services.core.db import Database, single_statement
from services.core.errors import FailedPrecondition, FieldViolation, InvalidArgument, NotFound
from services.core.key_cache import KeyCache
from services.core.schema import api_keys
from services.core.validation import require_id, text_violation

MAX_ALIAS = 100
MAX_ALLOWED_MODELS = 64
MAX_MODEL_NAME = 200
DEFAULT_OVERLAP_SECONDS = 24 * 3600.0
MAX_OVERLAP_SECONDS = 7 * 24 * 3600.0


@dataclass(frozen=True, slots=True)
class KeyScopes:
    """What a key may do: the models it may run (empty: every one), until when (None:
    for ever), and a name for people."""

    allowed_models: tuple[str, ...] = ()
    expire_time: datetime | None = None
    alias: str = ""


@dataclass(frozen=True, slots=True)
class KeyRecord:
    key_id: str
    tenant_id: str
    secret: str  # empty except right after creation or rotation
    revoked: bool
    scopes: KeyScopes = field(default_factory=KeyScopes)
    create_time: datetime | None = None
    last_used_time: datetime | None = None
    previous_secret_expire_time: datetime | None = None

    def audit_view(self) -> dict[str, Any]:
        """What an audit event shows of the key: everything but its secret."""
        return {
            "key_id": self.key_id,
            "tenant_id": self.tenant_id,
            "alias": self.scopes.alias,
            "allowed_models": list(self.scopes.allowed_models),
            "expire_time": self.scopes.expire_time,
            "revoked": self.revoked,
            "create_time": self.create_time,
            "previous_secret_expire_time": self.previous_secret_expire_time,
        }


def scope_violations(scopes: KeyScopes, now: datetime) -> list[FieldViolation]:
    violations = []
    if (bad_alias := text_violation("alias", scopes.alias, MAX_ALIAS)) is not None:
        violations.append(bad_alias)
    if len(scopes.allowed_models) > MAX_ALLOWED_MODELS:
        violations.append(
            FieldViolation("allowed_models", f"more than {MAX_ALLOWED_MODELS} models")
        )
    for n, model in enumerate(scopes.allowed_models[:MAX_ALLOWED_MODELS]):
        name = f"allowed_models[{n}]"
        if not model:
            violations.append(FieldViolation(name, "must not be empty"))
        elif (bad_model := text_violation(name, model, MAX_MODEL_NAME)) is not None:
            violations.append(bad_model)
    if scopes.expire_time is not None and scopes.expire_time <= now:
        violations.append(FieldViolation("expire_time", "must be in the future"))
    return violations


def overlap_violation(seconds: float) -> FieldViolation | None:
    """None for an overlap RotateApiKey takes."""
    if 0 <= seconds <= MAX_OVERLAP_SECONDS:
        return None
    return FieldViolation("overlap", f"must be from 0 to {MAX_OVERLAP_SECONDS:.0f} seconds")


class KeyStore:
    def __init__(self, db: Database, cache: KeyCache | None = None) -> None:
        """`cache`: where this process keeps keys that authenticated, which forgets a key
        once it is rotated or revoked here."""
        self.db = db
        self.cache = cache

    async def create(
        self, tenant_id: str, scopes: KeyScopes = KeyScopes(), actor: str = audit.ADMIN_ACTOR
    ) -> KeyRecord:
        require_id("tenant", tenant_id)
        key = new_key()
        try:
            async with self.db.begin() as conn:
                row = await _one(
                    conn,
                    api_keys.insert()
                    .values(
                        key_id=key.key_id,
                        tenant_id=tenant_id,
                        secret_hash=key.secret_hash,
                        created_at=sa.func.clock_timestamp(),
                        alias=scopes.alias,
                        allowed_models=list(scopes.allowed_models) or None,
                        expires_at=scopes.expire_time,
                    )
                    .returning(*api_keys.c),
                )
                created = _key(row, key.secret)
                await _audit(conn, "api_key.created", actor, None, created)
        except IntegrityError:  # the tenant's foreign key
            raise NotFound(f"tenant {tenant_id} does not exist") from None
        return created

    async def list(
        self, tenant_id: str, page_size: int, page_token: str
    ) -> tuple[list[KeyRecord], str]:
        """A page of the tenant's keys, oldest first, and the token of the next ('' at the end)."""
        require_id("tenant", tenant_id)
        try:
            size = paging.page_size(page_size)
            after = paging.decode(page_token, tenant_id)
        except paging.BadPageRequest as exc:
            raise InvalidArgument([FieldViolation(exc.field, exc.description)]) from None
        query = sa.select(api_keys).where(api_keys.c.tenant_id == tenant_id)
        if after is not None:
            position = sa.tuple_(api_keys.c.created_at, api_keys.c.key_id)
            query = query.where(position > sa.tuple_(after.created_at, after.entry_id))
        query = query.order_by(api_keys.c.created_at, api_keys.c.key_id).limit(size + 1)
        async with single_statement(self.db) as conn:
            keys = [_key(row._mapping) for row in await conn.execute(query)]
        if len(keys) <= size:
            return keys, ""
        last = keys[size - 1]
        assert last.create_time is not None
        return keys[:size], paging.encode(paging.PageKey(last.create_time, last.key_id, tenant_id))

    async def rotate(
        self,
        key_id: str,
        overlap: float = DEFAULT_OVERLAP_SECONDS,
        actor: str = audit.ADMIN_ACTOR,
    ) -> KeyRecord:
        """A new secret for the key; the one it replaces works for `overlap` seconds more."""
        require_id("API key", key_id)
        secret_hash, secret = _new_secret(key_id)
        async with self.db.begin() as conn:
            before = await _locked(conn, key_id)
            if before.revoked:
                raise FailedPrecondition(f"API key {key_id} is revoked", "KEY_REVOKED")
            ends = sa.func.clock_timestamp() + sa.func.make_interval(0, 0, 0, 0, 0, 0, overlap)
            row = await _one(
                conn,
                api_keys.update()
                .where(api_keys.c.key_id == key_id)
                .values(
                    secret_hash=secret_hash,
                    previous_secret_hash=api_keys.c.secret_hash if overlap > 0 else None,
                    previous_secret_expires_at=ends if overlap > 0 else None,
                )
                .returning(*api_keys.c),
            )
            rotated = _key(row, secret)
            await _audit(conn, "api_key.rotated", actor, before, rotated)
        self._forget(key_id)
        return rotated

    async def revoke(self, key_id: str, actor: str = audit.ADMIN_ACTOR) -> KeyRecord:
        require_id("API key", key_id)
        async with self.db.begin() as conn:
            before = await _locked(conn, key_id)
            if before.revoked:
                return before
            row = await _one(
                conn,
                api_keys.update()
                .where(api_keys.c.key_id == key_id)
                .values(revoked_at=sa.func.clock_timestamp())
                .returning(*api_keys.c),
            )
            revoked = _key(row)
            await _audit(conn, "api_key.revoked", actor, before, revoked)
        self._forget(key_id)
        return revoked

    def _forget(self, key_id: str) -> None:
        if self.cache is not None:
            self.cache.forget(key_id)


def _new_secret(key_id: str) -> tuple[str, str]:
    """(hash, whole key) of a new secret for `key_id`."""
    key = new_key()
    secret = key.secret.removeprefix(f"tg_{key.key_id}_")
    return key.secret_hash, f"tg_{key_id}_{secret}"


async def _locked(conn: AsyncConnection, key_id: str) -> KeyRecord:
    query = sa.select(api_keys).where(api_keys.c.key_id == key_id).with_for_update()
    row = (await conn.execute(query)).first()
    if row is None:
        raise NotFound(f"API key {key_id} does not exist")
    return _key(row._mapping)


async def _one(conn: AsyncConnection, statement: Any) -> Mapping[Any, Any]:
    row = (await conn.execute(statement)).first()
    assert row is not None
    return row._mapping


async def _audit(
    conn: AsyncConnection, kind: str, actor: str, before: KeyRecord | None, after: KeyRecord
) -> None:
    change = audit.AdminChange(
        type=kind,
        tenant_id=after.tenant_id,
        subject=after.key_id,
        actor=actor,
        before=audit.jsonable(before.audit_view()) if before is not None else None,
        after=audit.jsonable(after.audit_view()),
    )
    await audit.record(conn, change)


def _key(row: Mapping[Any, Any], secret: str = "") -> KeyRecord:
    return KeyRecord(
        key_id=row["key_id"],
        tenant_id=row["tenant_id"],
        secret=secret,
        revoked=row["revoked_at"] is not None,
        scopes=KeyScopes(
            allowed_models=tuple(row["allowed_models"] or ()),
            expire_time=row["expires_at"],
            alias=row["alias"],
        ),
        create_time=row["created_at"],
        last_used_time=row["last_used_at"],
        previous_secret_expire_time=row["previous_secret_expires_at"],
    )
