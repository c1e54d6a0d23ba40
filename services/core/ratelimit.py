"""Token buckets, and the failed authentications of each peer counted with them; no I/O.

A peer that keeps sending wrong keys would otherwise cost a key lookup per attempt for as
long as it likes. Each failure takes a token from the peer's bucket; while the bucket is
empty, that peer's calls are refused before any key is looked up, until it refills.
"""

from __future__ import annotations

import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass

# A client with a mistyped key sees its errors at once; a guesser is slowed to this rate.
FAILURE_BURST = 20
FAILURES_PER_SECOND = 2.0
# Buckets kept at most; full ones (peers that stopped failing) go first.
MAX_PEERS = 10_000


@dataclass(slots=True)
class TokenBucket:
    capacity: float
    per_second: float
    tokens: float
    updated: float

    def refill(self, now: float) -> None:
        self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.per_second)
        self.updated = now

    def take(self, now: float) -> None:
        """Takes one token, or what is left of one."""
        self.refill(now)
        self.tokens = max(0.0, self.tokens - 1)

    def wait(self, now: float) -> float:
        """Seconds until a whole token is there; 0 when one is."""
        self.refill(now)
        return 0.0 if self.tokens >= 1 else (1 - self.tokens) / self.per_second

    def is_full(self, now: float) -> bool:
        self.refill(now)
        return self.tokens >= self.capacity


def peer_host(peer: str) -> str:
    """The host of a transport peer: `10.0.0.1` of gRPC's `ipv4:10.0.0.1:52114`, `::1` of
    `ipv6:[::1]:52114`, and an HTTP client's address as it is. A client's connections share
    a bucket whatever their ports, and whichever front door they came through."""
    family, sep, rest = peer.partition(":")
    if not sep or family not in ("ipv4", "ipv6"):
        return peer
    # gRPC percent-encodes an IPv6 address's brackets: `ipv6:%5B::1%5D:52114`.
    host, _, port = urllib.parse.unquote(rest).rpartition(":")
    if not host or not port.isdigit():
        return rest
    return host.removeprefix("[").removesuffix("]")


class FailedAttempts:
    """Failed authentications, a bucket per peer."""

    def __init__(
        self,
        burst: int = FAILURE_BURST,
        per_second: float = FAILURES_PER_SECOND,
        max_peers: int = MAX_PEERS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.burst = burst
        self.per_second = per_second
        self.max_peers = max_peers
        self.clock = clock
        self._buckets: dict[str, TokenBucket] = {}

    @property
    def num_peers(self) -> int:
        return len(self._buckets)

    def retry_after(self, peer: str) -> float:
        """Seconds before `peer` may try again; 0 when it may now."""
        bucket = self._buckets.get(peer_host(peer))
        return 0.0 if bucket is None else bucket.wait(self.clock())

    def failed(self, peer: str) -> None:
        now = self.clock()
        host = peer_host(peer)
        bucket = self._buckets.get(host)
        if bucket is None:
            if len(self._buckets) >= self.max_peers:
                self._forget(now)
            bucket = self._buckets[host] = TokenBucket(self.burst, self.per_second, self.burst, now)
        bucket.take(now)

    def _forget(self, now: float) -> None:
        """Drops the full buckets, else the least recently used half: memory stays bounded."""
        by_age = sorted(self._buckets, key=lambda host: self._buckets[host].updated)
        full = [host for host in by_age if self._buckets[host].is_full(now)]
        for host in full or by_age[: len(by_age) // 2 + 1]:
            del self._buckets[host]
