"""Metrics setup shared by every process: the /metrics listener and the bounded labels.

Each process serves one Prometheus endpoint at TOLLGATE_METRICS_LISTEN. Two libraries
write to it, each for one job: `prometheus_client` for the Tollgate series (defined next
to what they measure, in each service's `metrics.py`), and the OpenTelemetry SDK for the
GenAI semantic-convention metrics, through its Prometheus reader. The OTel meter exists
only once the listener is configured: `meter()` is None before, and nothing is recorded.

A `tenant` label takes one value per tenant it names and `other` for the rest, so a
stack of many tenants keeps a bounded number of series: the tenants of
TOLLGATE_METRICS_TENANTS when set, else the TOLLGATE_METRICS_TOP_TENANTS of highest
weight, read again from the tenants table every minute.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterable
from typing import Any

import sqlalchemy as sa
import structlog
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import Meter
from opentelemetry.sdk.metrics import MeterProvider
from prometheus_client import start_http_server

from services.core.config import MetricsSettings, parse_listen
from services.core.db import Database
from services.core.telemetry import service_resource

log = structlog.get_logger(__name__)

OTHER_TENANT = "other"
TENANT_REFRESH_SECONDS = 60.0


class TenantLabels:
    """The `tenant` label of a tenant id: itself when named, else `other` (no I/O)."""

    def __init__(self, named: Iterable[str] = ()) -> None:
        self.named = frozenset(named)

    def of(self, tenant_id: str) -> str:
        return tenant_id if tenant_id in self.named else OTHER_TENANT


TENANTS = TenantLabels()
_meter: Meter | None = None


def meter() -> Meter | None:
    """The OTel meter of this process; None while /metrics is off."""
    return _meter


def start_metrics(
    settings: MetricsSettings, service: str, db: Database
) -> tuple[int | None, list[Coroutine[Any, Any, None]]]:
    """Serves /metrics where `settings` say and installs the OTel meter provider that
    writes to it; returns the bound port (None when off) and the loops to run beside."""
    global _meter
    if not settings.listen:
        return None, []
    TENANTS.named = settings.tenants
    if _meter is None:
        provider = MeterProvider(
            metric_readers=[PrometheusMetricReader()], resource=service_resource(service)
        )
        _meter = provider.get_meter("tollgate")
    host, port = parse_listen(settings.listen)
    http_server, _ = start_http_server(port, addr=host)
    return int(http_server.server_port), [refresh_tenant_labels(db, settings)]


async def refresh_tenant_labels(db: Database, settings: MetricsSettings) -> None:
    """Keeps TENANTS on the top tenants by weight, unless an allow list names them."""
    if settings.tenants:
        return
    query = sa.text(
        "SELECT tenant_id FROM tenants ORDER BY weight DESC, created_at LIMIT :n"
    ).bindparams(n=settings.top_tenants)
    while True:
        try:
            async with db.connect() as conn:
                TENANTS.named = frozenset((await conn.execute(query)).scalars())
        except Exception as error:  # the labels are kept; the next round tries again
            log.warning("tenant labels not refreshed", error=repr(error))
        await asyncio.sleep(TENANT_REFRESH_SECONDS)
