"""API keys and the admin token: parsing, hashing, constant-time checks, scopes.

A key reads `tg_<key_id>_<secret>`: the key id is the prefix it is looked up by, and
only SHA-256 of the secret is stored. The secrets are 256-bit random values, so a fast
hash is enough: there is nothing to brute-force that a slow hash would protect.

A key may be limited to some models (`require_model`), may expire, and after a rotation
its previous secret works until the overlap the rotation set ends. An expired key is
told apart only once its secret matched, so an error never says more to a guesser.

Failing is cheap: a key not of the shape `new_key` makes is refused without a query,
and a peer that fails too often is refused for a while before its keys are looked up.
A success costs no write: `usage` notes the key's use in memory (services.core.key_usage),
and with a `cache` no query either while the key's answer is recent (services.core.key_cache).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from services.core.codec import rfc3339
from services.core.db import Database, driver_cursor, single_statement
from services.core.errors import PermissionDenied, QuotaExceeded, Unauthenticated
from services.core.key_cache import KeyCache
from services.core.key_usage import KeyUsage
from services.core.ratelimit import FailedAttempts, peer_host
from services.core.validation import shown

KEY_PREFIX = "tg_"
KEY_ID_LENGTH = 16
# What new_key makes: key ids of token_hex, secrets of token_urlsafe (43 characters).
KEY_ID = re.compile(f"[0-9a-f]{{{KEY_ID_LENGTH}}}")
SECRET = re.compile("[A-Za-z0-9_-]{16,128}")


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: a tenant through one of its keys, or the administrator."""

    tenant_id: str | None
    is_admin: bool = False
    key_id: str | None = None
    allowed_models: frozenset[str] = frozenset()  # empty: every model
    # The hash of the secret the caller gave (the key's, or its previous one in its
    # overlap): what a stream is checked against while it lasts.
    secret_hash: str = ""

    def may_use(self, model: str) -> bool:
        return not self.allowed_models or model in self.allowed_models


def require_model(principal: Principal, model: str) -> None:
    """Raises PermissionDenied (naming `model`) when the caller's key may not run `model`."""
    if not principal.may_use(model):
        raise PermissionDenied(
            f"model: this API key may not use the model {shown(model)}",
            field="model",
            reason="MODEL_NOT_ALLOWED",
        )


@dataclass(frozen=True, slots=True)
class NewKey:
    key_id: str
    secret: str  # the whole `tg_...` string, shown once
    secret_hash: str


def new_key() -> NewKey:
    key_id = secrets.token_hex(KEY_ID_LENGTH // 2)
    secret = secrets.token_urlsafe(32)
    return NewKey(key_id, f"{KEY_PREFIX}{key_id}_{secret}", hash_secret(secret))


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def split_key(key: str) -> tuple[str, str] | None:
    """(key_id, secret) of a key of the shape `new_key` makes, else None."""
    if not key.startswith(KEY_PREFIX) or len(key) < len(KEY_PREFIX) + KEY_ID_LENGTH + 2:
        return None
    body = key[len(KEY_PREFIX) :]
    key_id, sep, secret = body[:KEY_ID_LENGTH], body[KEY_ID_LENGTH], body[KEY_ID_LENGTH + 1 :]
    if sep != "_" or not KEY_ID.fullmatch(key_id) or not SECRET.fullmatch(secret):
        return None
    return key_id, secret


def bearer_token(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    for name, value in metadata or ():
        if name.lower() == "authorization":
            text = value.decode() if isinstance(value, bytes) else value
            scheme, _, token = text.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


def is_admin_token(token: str, admin_token: str) -> bool:
    return bool(admin_token) and hmac.compare_digest(token.encode(), admin_token.encode())


# Every call of every client starts here.
_KEY = """
    SELECT tenant_id, secret_hash, allowed_models, expires_at,
           expires_at <= clock_timestamp() AS expired,
           extract(epoch FROM expires_at - clock_timestamp())::float8 AS expires_in,
           CASE WHEN previous_secret_expires_at > clock_timestamp()
                THEN previous_secret_hash END AS previous_secret_hash,
           extract(epoch FROM previous_secret_expires_at - clock_timestamp())::float8
               AS previous_expires_in
    FROM api_keys WHERE key_id = %s AND revoked_at IS NULL
"""


async def authenticate(
    db: Database,
    metadata: Sequence[tuple[str, str | bytes]] | None,
    *,
    admin_token: str = "",
    allow_admin: bool = False,
    peer: str = "",
    failures: FailedAttempts | None = None,
    usage: KeyUsage | None = None,
    cache: KeyCache | None = None,
) -> Principal:
    """The caller behind `authorization: Bearer ...`; raises Unauthenticated.

    With `failures`, each failure counts against `peer`, and a peer past its rate of
    failures is refused (QuotaExceeded, RATE_LIMITED) before its key is looked up. With
    `usage`, the key's use is noted there; with `cache`, a secret that authenticated
    lately is not looked up again."""
    lookup = _Lookup(db, cache)
    principal = await _checked(lookup, metadata, admin_token, allow_admin, peer, failures)
    if usage is not None and principal.key_id is not None:
        usage.used(principal.key_id)
    return principal


async def _checked(
    lookup: _Lookup,
    metadata: Sequence[tuple[str, str | bytes]] | None,
    admin_token: str,
    allow_admin: bool,
    peer: str,
    failures: FailedAttempts | None,
) -> Principal:
    if failures is None:
        return await _authenticate(lookup, metadata, admin_token, allow_admin)
    _refuse_if_failing(failures, peer)
    try:
        return await _authenticate(lookup, metadata, admin_token, allow_admin)
    except Unauthenticated:
        failures.failed(peer)
        raise


def require_admin(
    metadata: Sequence[tuple[str, str | bytes]] | None,
    admin_token: str,
    *,
    peer: str,
    failures: FailedAttempts,
) -> None:
    """Raises Unauthenticated unless `authorization` carries the admin token; each miss
    counts against `peer` as a failed key does, so the token is no easier to guess."""
    if not admin_token:
        raise Unauthenticated("the admin API is disabled: TOLLGATE_ADMIN_TOKEN is not set")
    _refuse_if_failing(failures, peer)
    token = bearer_token(metadata)
    if token is None or not is_admin_token(token, admin_token):
        failures.failed(peer)
        raise Unauthenticated("missing or wrong admin token")


def _refuse_if_failing(failures: FailedAttempts, peer: str) -> None:
    wait = failures.retry_after(peer)
    if wait:
        raise QuotaExceeded(
            "too many failed authentications from this address; retry later",
            subject=f"peer:{peer_host(peer)}:failed_authentications",
            retry_after=wait,
            reason="RATE_LIMITED",
        )


async def _authenticate(
    lookup: _Lookup,
    metadata: Sequence[tuple[str, str | bytes]] | None,
    admin_token: str,
    allow_admin: bool,
) -> Principal:
    token = bearer_token(metadata)
    if token is None:
        raise Unauthenticated("missing authorization: Bearer <api key>")
    if allow_admin and is_admin_token(token, admin_token):
        return Principal(tenant_id=None, is_admin=True)
    parts = split_key(token)
    if parts is None:
        raise Unauthenticated("invalid API key")
    key_id, secret = parts
    secret_hash = hash_secret(secret)
    if lookup.cache is not None:
        cached = lookup.cache.get(key_id, secret_hash)
        if cached is not None:
            return cached
    async with single_statement(lookup.db) as conn, driver_cursor(conn) as cursor:
        await cursor.execute(_KEY, (key_id,))
        row = await cursor.fetchone()
    matched = _secret_matched(secret_hash, row)
    if row is None or matched is None:
        raise Unauthenticated("invalid API key")
    if row["expired"]:
        raise Unauthenticated(f"API key {key_id} expired at {rfc3339(row['expires_at'])}")
    principal = Principal(
        tenant_id=row["tenant_id"],
        key_id=key_id,
        allowed_models=frozenset(row["allowed_models"] or ()),
        secret_hash=secret_hash,
    )
    if lookup.cache is not None:
        bounds = [row["expires_in"], row["previous_expires_in"] if matched == "previous" else None]
        lookup.cache.put(principal, min((b for b in bounds if b is not None), default=None))
    return principal


@dataclass(frozen=True, slots=True)
class _Lookup:
    db: Database
    cache: KeyCache | None


def _secret_matched(given: str, row: dict[str, Any] | None) -> str | None:
    """Which of the key's secrets the hash `given` is: "current", "previous" (still in its
    overlap) or None. Both are compared whatever the row, so timing does not tell which
    part was wrong."""
    current = row["secret_hash"] if row else _decoy()
    previous = (row["previous_secret_hash"] if row else None) or _decoy()
    matches_current = hmac.compare_digest(given, current)
    matches_previous = hmac.compare_digest(given, previous)
    if row is None:
        return None
    if matches_current:
        return "current"
    return "previous" if matches_previous else None


def _decoy() -> str:
    return hash_secret(secrets.token_hex(8))
