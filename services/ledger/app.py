"""The ledger process: LedgerService, the terminal-event consumer, the sweep, a relay."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
import structlog
from grpc_health.v1 import health

from services.core.config import CommonSettings, admin_token_from_env, env_float, env_str
from services.core.db import Database, open_db
from services.core.metrics import start_metrics
from services.core.pricing import DEFAULT_CURRENCY, PriceTable, parse_discount, parse_prices
from services.core.relay import OutboxRelay
from services.core.server import bound_address, create_server, serve
from services.core.tls import ServerTls
from services.ledger.consumer import LedgerConsumer
from services.ledger.reconcile import DEFAULT_STUCK_AFTER_SECONDS
from services.ledger.servicer import LedgerServicer
from services.ledger.sweep import Sweeper
from tollgate.v1 import ledger_pb2, ledger_pb2_grpc

SERVICE_NAMES = (ledger_pb2.DESCRIPTOR.services_by_name["LedgerService"].full_name,)
RESTART_DELAY = 1.0

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class LedgerSettings:
    common: CommonSettings
    admin_token: str
    prices: PriceTable
    sweep_interval: float
    sweep_grace: float
    # A run not ended this long after its creation is reported stuck.
    stuck_after: float = DEFAULT_STUCK_AFTER_SECONDS
    tls: ServerTls | None = None

    @classmethod
    def from_env(cls) -> LedgerSettings:
        currency = env_str("TOLLGATE_CURRENCY", DEFAULT_CURRENCY)
        return cls(
            common=CommonSettings.from_env(),
            admin_token=admin_token_from_env(),
            prices=parse_prices(
                os.environ.get("TOLLGATE_PRICES"),
                currency,
                parse_discount(os.environ.get("TOLLGATE_BATCH_DISCOUNT")),
            ),
            sweep_interval=env_float("TOLLGATE_LEDGER_SWEEP_INTERVAL", 5.0),
            sweep_grace=env_float("TOLLGATE_LEDGER_SWEEP_GRACE", 10.0),
            stuck_after=env_float("TOLLGATE_LEDGER_STUCK_SECONDS", DEFAULT_STUCK_AFTER_SECONDS),
            tls=ServerTls.from_env(),
        )


def create_ledger_server(
    db: Database, settings: LedgerSettings
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """The gRPC server with LedgerService and health, bound but not started."""
    servicer = LedgerServicer(
        db,
        admin_token=settings.admin_token,
        currency=settings.prices.currency,
        sweep_grace=settings.sweep_grace,
        stuck_after=settings.stuck_after,
    )
    return create_server(
        settings.common.listen,
        lambda server: ledger_pb2_grpc.add_LedgerServiceServicer_to_server(servicer, server),
        tls=settings.tls,
    )


async def keep_running(name: str, job: Callable[[], Awaitable[None]]) -> None:
    """Restarts `job` after a failure, so a broker outage does not end the process."""
    while True:
        try:
            await job()
        except Exception as exc:
            log.warning("background task failed; restarting", task=name, error=str(exc))
        await asyncio.sleep(RESTART_DELAY)


async def main(settings: LedgerSettings) -> None:
    db = open_db(settings.common.database_url, pool_size=settings.common.db_pool_size)
    common = settings.common
    consumer = LedgerConsumer(db, common.kafka_bootstrap, settings.prices, topic=common.topic)
    sweeper = Sweeper(
        db, settings.prices, interval=settings.sweep_interval, grace=settings.sweep_grace
    )
    relay = OutboxRelay.from_settings(db, common)
    server, port, health_servicer = create_ledger_server(db, settings)
    metrics_port, metrics_tasks = start_metrics(common.metrics, "ledger", db)
    address = bound_address(common.listen, port)
    log.info("serving", address=address, metrics_port=metrics_port)
    try:
        await serve(
            server,
            health_servicer,
            SERVICE_NAMES,
            [
                keep_running("consumer", consumer.run),
                sweeper.run(),
                relay.run(),
                *metrics_tasks,
            ],
            address=address,
        )
    finally:
        await db.dispose()
