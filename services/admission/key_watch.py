"""Ends the streams of keys that no longer authenticate: revoked, expired, or rotated
away from the secret the stream was opened with once its overlap is over.

A key is checked when a call authenticates; a stream outlives that call. So while any
stream is open, the credentials behind them are read back every `interval` seconds, all
in one statement; a stream whose credential stopped working is woken and ends with
UNAUTHENTICATED within about that long.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import Iterator

import structlog

from services.admission.stream import RunFeed
from services.core.auth import Principal
from services.core.db import Database, driver_cursor, single_statement
from services.core.errors import DATABASE_AWAY, Unauthenticated
from services.core.loop import stop_if_cancelled

log = structlog.get_logger(__name__)

KEY_CHECK_SECONDS = 5.0

# The watched credentials that no longer authenticate, as services.core.auth decides.
_LAPSED = """
    SELECT w.key_id, w.secret_hash
    FROM unnest(%(key_ids)s::text[], %(hashes)s::text[]) AS w(key_id, secret_hash)
    WHERE NOT EXISTS (
        SELECT 1 FROM api_keys k
        WHERE k.key_id = w.key_id AND k.revoked_at IS NULL
          AND (k.expires_at IS NULL OR k.expires_at > clock_timestamp())
          AND (k.secret_hash = w.secret_hash
               OR (k.previous_secret_hash = w.secret_hash
                   AND k.previous_secret_expires_at > clock_timestamp())))
"""

Credential = tuple[str, str]  # key_id, the hash of the secret given


class KeyWatch:
    def __init__(self, db: Database, feed: RunFeed, interval: float = KEY_CHECK_SECONDS) -> None:
        self.db = db
        self.feed = feed
        self.interval = interval
        # credential -> the runs streamed with it here, one entry per stream
        self._streams: defaultdict[Credential, list[str]] = defaultdict(list)
        self._lapsed: set[Credential] = set()

    @contextlib.contextmanager
    def watching(self, principal: Principal, run_id: str) -> Iterator[Credential | None]:
        """Watches the credential of a stream of `run_id` while the block runs; yields it
        (None for a caller without a key, which nothing revokes)."""
        if principal.key_id is None:
            yield None
            return
        credential = (principal.key_id, principal.secret_hash)
        self._streams[credential].append(run_id)
        try:
            yield credential
        finally:
            self._streams[credential].remove(run_id)
            if not self._streams[credential]:
                del self._streams[credential]
                self._lapsed.discard(credential)

    def has_lapsed(self, credential: Credential | None) -> bool:
        return credential is not None and credential in self._lapsed

    def ended(self, credential: Credential) -> Unauthenticated:
        return Unauthenticated(
            f"API key {credential[0]} no longer authenticates (revoked, expired or "
            "rotated); the stream ended"
        )

    async def run(self) -> None:
        """Checks the watched credentials every `interval` seconds until cancelled."""
        while True:
            stop_if_cancelled()
            try:
                await self.check()
            except DATABASE_AWAY as error:
                log.warning("stream keys not checked", error=type(error).__name__)
            await asyncio.sleep(self.interval)

    async def check(self) -> None:
        """Marks the credentials that lapsed and wakes their streams to end."""
        watched = [c for c in self._streams if c not in self._lapsed]
        if not watched:
            return
        params = {"key_ids": [c[0] for c in watched], "hashes": [c[1] for c in watched]}
        async with single_statement(self.db) as conn, driver_cursor(conn) as cursor:
            await cursor.execute(_LAPSED, params)
            lapsed = [(row["key_id"], row["secret_hash"]) for row in await cursor.fetchall()]
        for credential in lapsed:
            if credential in self._streams:
                self._lapsed.add(credential)
                log.info("ending the streams of a lapsed key", key_id=credential[0])
                for run_id in set(self._streams[credential]):
                    self.feed.wake(run_id)
