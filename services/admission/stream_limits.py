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


def streams_limited(tenant_id: str, limit: int) -> QuotaExceeded:
    return QuotaExceeded(
        f"stream quota: {limit} of {limit} streams open; close one or retry later",
        subject=f"tenant:{tenant_id}:concurrent_streams",
        retry_after=STREAMS_RETRY_SECONDS,
        reason="STREAMS_LIMITED",
    )


class StreamCounts:
    """The streams each tenant holds open here; a limit of 0 is no limit."""

    def __init__(self) -> None:
        self._open: Counter[str] = Counter()

    def num_open(self, tenant_id: str) -> int:
        return self._open[tenant_id]

    def is_full(self, tenant_id: str, limit: int) -> bool:
        """Whether one more stream would be too many."""
        return bool(limit) and self._open[tenant_id] >= limit

    def check(self, tenant_id: str, limit: int) -> None:
        """Raises QuotaExceeded (STREAMS_LIMITED) when one more stream would be too many."""
        if self.is_full(tenant_id, limit):
            raise streams_limited(tenant_id, limit)

    @contextlib.contextmanager
    def held(self, tenant_id: str, limit: int) -> Iterator[None]:
        """One stream, counted while the block runs; refused as `check` refuses."""
        self.check(tenant_id, limit)
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
