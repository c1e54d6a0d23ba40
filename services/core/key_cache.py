"""Keys that authenticated lately, so that a client's calls do not each cost a query.

An entry is what authenticated one secret of one key (the Principal) and how long it
may stand for the database's answer: `seconds` after the answer was read, and never past
the key's expiry or, for a previous secret, the end of its overlap, as the database's
clock had them. So a key revoked, or rotated with no overlap, by another process stops
working within `seconds`; this process forgets the keys it changes itself at once
(`forget`). Only successes are kept: a wrong secret is looked up every time, behind the
peer's failure limit.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.core.auth import Principal

KEY_CACHE_SECONDS = 5.0
MAX_ENTRIES = 10_000


@dataclass(frozen=True, slots=True)
class _Entry:
    principal: Principal
    until: float  # of `clock`


class KeyCache:
    def __init__(
        self,
        seconds: float = KEY_CACHE_SECONDS,
        max_entries: int = MAX_ENTRIES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.seconds = seconds
        self.max_entries = max_entries
        self.clock = clock
        # (key_id, secret hash) -> entry, least recently used first
        self._entries: OrderedDict[tuple[str, str], _Entry] = OrderedDict()

    def get(self, key_id: str, secret_hash: str) -> Principal | None:
        entry = self._entries.get((key_id, secret_hash))
        if entry is None:
            return None
        if self.clock() >= entry.until:
            del self._entries[(key_id, secret_hash)]
            return None
        self._entries.move_to_end((key_id, secret_hash))
        return entry.principal

    def put(self, principal: Principal, valid_for: float | None) -> None:
        """Keeps `principal` for `seconds`, or `valid_for` seconds when that is sooner
        (None: the secret does not expire)."""
        assert principal.key_id is not None
        seconds = self.seconds if valid_for is None else min(self.seconds, valid_for)
        if seconds <= 0:
            return
        key = (principal.key_id, principal.secret_hash)
        self._entries[key] = _Entry(principal, self.clock() + seconds)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def forget(self, key_id: str) -> None:
        """Drops every secret of `key_id` kept here."""
        for key in [k for k in self._entries if k[0] == key_id]:
            del self._entries[key]

    def __len__(self) -> int:
        return len(self._entries)
