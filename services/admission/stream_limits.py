"""How many streams each tenant holds open, against its `max_concurrent_streams`.

Every open stream costs this replica a database read whenever its run is quiet and a
place in the event feed; one key opening thousands would take the connection pool from
every tenant. Streams are counted in memory, per admission replica: a tenant served by N
replicas may hold up to N times its limit in all, which is what the limit is for, since
each replica's pool is its own.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterator

from services.admission.tenant_store import TenantStore
from services.core.errors import QuotaExceeded

DEFAULT_MAX_CONCURRENT_STREAMS = 64
STREAMS_RETRY_SECONDS = 1.0
# A quota changed by SetQuota binds new streams within this long.
LIMIT_TTL_SECONDS = 5.0
# A run's stream follows its admission at once; a reservation left longer was dropped.
RESERVATION_TTL_SECONDS = 10.0


def streams_limited(tenant_id: str, limit: int) -> QuotaExceeded:
    return QuotaExceeded(
        f"stream quota: {limit} of {limit} streams open; close one or retry later",
        subject=f"tenant:{tenant_id}:concurrent_streams",
        retry_after=STREAMS_RETRY_SECONDS,
        reason="STREAMS_LIMITED",
    )


class StreamCounts:
    """The streams each tenant holds open here, and those reserved for runs being admitted;
    a limit of 0 is no limit.

    A run is admitted with its stream reserved, so that requests racing near the limit
    are refused before their runs exist, not after. The stream that follows the run claims
    the reservation; one never claimed (its front failed before streaming) lapses after
    `reservation_ttl` seconds."""

    def __init__(
        self,
        reservation_ttl: float = RESERVATION_TTL_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.reservation_ttl = reservation_ttl
        self.clock = clock
        self._open: Counter[str] = Counter()
        # tenant -> run_id -> when the reservation lapses
        self._reserved: dict[str, dict[str, float]] = {}

    def num_open(self, tenant_id: str) -> int:
        return self._open[tenant_id]

    def num_held(self, tenant_id: str) -> int:
        """Open streams and live reservations."""
        reserved = self._reserved.get(tenant_id)
        if reserved:
            now = self.clock()
            for run_id in [r for r, until in reserved.items() if until <= now]:
                del reserved[run_id]
            if not reserved:
                del self._reserved[tenant_id]
        return self._open[tenant_id] + len(self._reserved.get(tenant_id, ()))

    def is_full(self, tenant_id: str, limit: int) -> bool:
        """Whether one more stream would be too many."""
        return bool(limit) and self.num_held(tenant_id) >= limit

    def check(self, tenant_id: str, limit: int, run_id: str = "") -> None:
        """Raises QuotaExceeded (STREAMS_LIMITED) when one more stream would be too many,
        unless `run_id` has its stream reserved."""
        if self.is_full(tenant_id, limit) and run_id not in self._reserved.get(tenant_id, {}):
            raise streams_limited(tenant_id, limit)

    def reserve(self, tenant_id: str, limit: int, run_id: str) -> None:
        """Holds a stream for the run about to be admitted; refused as `check` refuses. A
        tenant without a limit holds nothing: there is nothing to race for."""
        if not limit:
            return
        self.check(tenant_id, limit)
        self._reserved.setdefault(tenant_id, {})[run_id] = self.clock() + self.reservation_ttl

    def renew(self, tenant_id: str, run_id: str) -> None:
        """Starts the run's reservation's time again (its run has just been admitted)."""
        reserved = self._reserved.get(tenant_id, {})
        if run_id in reserved:
            reserved[run_id] = self.clock() + self.reservation_ttl

    def release(self, tenant_id: str, run_id: str) -> bool:
        """Gives up the run's reservation; whether it had one still."""
        reserved = self._reserved.get(tenant_id, {})
        found = reserved.pop(run_id, None) is not None
        if not reserved:
            self._reserved.pop(tenant_id, None)
        return found

    @contextlib.contextmanager
    def held(self, tenant_id: str, limit: int, run_id: str = "") -> Iterator[None]:
        """One stream, counted while the block runs: the run's reservation where it has
        one, else a new stream, refused as `check` refuses."""
        self.check(tenant_id, limit, run_id)
        self.release(tenant_id, run_id)
        self._open[tenant_id] += 1
        try:
            yield
        finally:
            self._open[tenant_id] -= 1
            if not self._open[tenant_id]:
                del self._open[tenant_id]


class StreamLimits:
    """Each tenant's `max_concurrent_streams`, or `default` where it has none; read from
    the tenant's row at most once per `ttl` seconds."""

    def __init__(
        self,
        tenants: TenantStore,
        default: int = DEFAULT_MAX_CONCURRENT_STREAMS,
        ttl: float = LIMIT_TTL_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tenants = tenants
        self.default = default
        self.ttl = ttl
        self.clock = clock
        self._known: dict[str, tuple[float, int]] = {}

    async def get(self, tenant_id: str) -> int:
        now = self.clock()
        known = self._known.get(tenant_id)
        if known is not None and known[0] > now:
            return known[1]
        tenant = await self.tenants.get(tenant_id)
        limit = (
            self.default if tenant.max_concurrent_streams is None else tenant.max_concurrent_streams
        )
        self._known[tenant_id] = (now + self.ttl, limit)
        return limit
