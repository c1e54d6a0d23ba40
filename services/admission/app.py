"""The admission process: `python -m services.admission`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TypeVar

import grpc
import structlog

from services.admission.backpressure import QueueBounds
from services.admission.batches import DEFAULT_IN_FLIGHT, BatchDriver
from services.admission.cancel import Canceller
from services.admission.catalog import ModelCatalog
from services.admission.gateway import Gateway, GatewayConfig
from services.admission.grpc.admin_servicer import AdminServicer
from services.admission.grpc.gateway_servicer import GatewayServicer
from services.admission.http.app import create_app
from services.admission.http.limits import DEFAULT_LIMITS, MAX_JSON_DEPTH, HttpLimits
from services.admission.http.server import HttpServer
from services.admission.requests import Limits
from services.admission.scheduler_client import SchedulerClient
from services.admission.stream import RunFeed
from services.admission.stream_limits import DEFAULT_MAX_CONCURRENT_STREAMS
from services.admission.tenant_gate import DEFAULT_ADMISSIONS_PER_TENANT
from services.admission.tenant_store import DEFAULT_MAX_CONCURRENT_RUNS
from services.console import ConsoleSettings, console_router
from services.core.config import (
    CommonSettings,
    ConfigError,
    admin_token_from_env,
    env_float,
    env_int,
    env_map,
    env_str,
)
from services.core.db import open_db
from services.core.event_store import EventStore
from services.core.key_cache import KEY_CACHE_SECONDS
from services.core.metrics import start_metrics
from services.core.pricing import DEFAULT_CURRENCY, parse_prices
from services.core.relay import OutboxRelay
from services.core.server import bound_address, create_server, serve
from services.core.tls import ServerTls
from tollgate.v1 import (
    admin_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
)

log = structlog.get_logger(__name__)
N = TypeVar("N", int, float)

SERVICES = (
    gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name,
    "tollgate.v1.AdminService",
)


@dataclass(frozen=True, slots=True)
class AdmissionSettings:
    common: CommonSettings
    models: dict[str, str]
    adapters: dict[str, str]
    admin_token: str
    scheduler_address: str
    http_listen: str
    config: GatewayConfig
    default_max_concurrent_runs: int
    tls: ServerTls | None = None
    http_limits: HttpLimits = DEFAULT_LIMITS
    # How many of a batch's runs may be unended at once (TOLLGATE_BATCH_IN_FLIGHT).
    batch_in_flight: int = DEFAULT_IN_FLIGHT

    @classmethod
    def from_env(cls) -> AdmissionSettings:
        limits = Limits(
            max_tokens=env_int("TOLLGATE_MAX_TOKENS", 4096),
            max_message_chars=env_int("TOLLGATE_MAX_MESSAGE_CHARS", 65_536),
            default_disconnect_grace=env_float("TOLLGATE_DISCONNECT_GRACE", 30.0),
        )
        return cls(
            common=CommonSettings.from_env("127.0.0.1:50051"),
            models=env_map("TOLLGATE_MODELS"),
            adapters=env_map("TOLLGATE_ADAPTERS"),
            admin_token=admin_token_from_env(),
            scheduler_address=env_str("TOLLGATE_SCHEDULER_ADDRESS", ""),
            http_listen=_http_listen(),
            config=GatewayConfig(
                limits=limits,
                block_size=env_int("TOLLGATE_BLOCK_SIZE", 16),
                queue=QueueBounds(
                    max_queue_depth=env_int("TOLLGATE_MAX_QUEUE_DEPTH", 10_000),
                    tenant_share=env_float("TOLLGATE_TENANT_QUEUE_SHARE", 0.5),
                    max_interactive_depth=env_int("TOLLGATE_MAX_INTERACTIVE_QUEUE_DEPTH", 0),
                    max_batch_depth=env_int("TOLLGATE_MAX_BATCH_QUEUE_DEPTH", 0),
                    batch_kv_watermark=env_float("TOLLGATE_BATCH_KV_WATERMARK", -1.0),
                    interactive_kv_watermark=env_float("TOLLGATE_INTERACTIVE_KV_WATERMARK", -2.0),
                ),
                max_concurrent_streams=env_int(
                    "TOLLGATE_MAX_CONCURRENT_STREAMS", DEFAULT_MAX_CONCURRENT_STREAMS
                ),
                prices=parse_prices(
                    os.environ.get("TOLLGATE_PRICES"),
                    env_str("TOLLGATE_CURRENCY", DEFAULT_CURRENCY),
                ),
                key_cache_seconds=env_float("TOLLGATE_KEY_CACHE_SECONDS", KEY_CACHE_SECONDS),
                admissions_per_tenant=env_int(
                    "TOLLGATE_ADMISSIONS_PER_TENANT", DEFAULT_ADMISSIONS_PER_TENANT
                ),
            ),
            default_max_concurrent_runs=env_int(
                "TOLLGATE_DEFAULT_MAX_CONCURRENT_RUNS", DEFAULT_MAX_CONCURRENT_RUNS
            ),
            tls=ServerTls.from_env(),
            http_limits=_http_limits(),
            batch_in_flight=_positive("TOLLGATE_BATCH_IN_FLIGHT", DEFAULT_IN_FLIGHT),
        )


def _http_listen() -> str:
    """Where the HTTP front door listens; `off` (or nothing) serves gRPC only."""
    listen = env_str("TOLLGATE_HTTP_LISTEN", "127.0.0.1:8080")
    return "" if listen.lower() == "off" else listen


def _http_limits() -> HttpLimits:
    """What one client may take of the HTTP port (docs/SECURITY.md's limits)."""
    default = DEFAULT_LIMITS
    limits = HttpLimits(
        max_body_bytes=_positive("TOLLGATE_HTTP_MAX_BODY_BYTES", default.max_body_bytes),
        max_json_depth=_positive("TOLLGATE_HTTP_MAX_JSON_DEPTH", default.max_json_depth),
        max_connections=_positive("TOLLGATE_HTTP_MAX_CONNECTIONS", default.max_connections),
        max_connections_per_client=_positive(
            "TOLLGATE_HTTP_MAX_CONNECTIONS_PER_CLIENT", default.max_connections_per_client
        ),
        max_header_bytes=_positive("TOLLGATE_HTTP_MAX_HEADER_BYTES", default.max_header_bytes),
        max_headers=_positive("TOLLGATE_HTTP_MAX_HEADERS", default.max_headers),
        header_timeout=_seconds("TOLLGATE_HTTP_HEADER_TIMEOUT", default.header_timeout),
        body_timeout=_seconds("TOLLGATE_HTTP_BODY_TIMEOUT", default.body_timeout),
        responses_retention=_seconds("TOLLGATE_RESPONSES_RETENTION", default.responses_retention),
        trusted_proxies=tuple(
            proxy.strip()
            for proxy in env_str("TOLLGATE_HTTP_TRUSTED_PROXIES", "").split(",")
            if proxy.strip()
        ),
    )
    if limits.max_json_depth > MAX_JSON_DEPTH:
        raise ConfigError(f"TOLLGATE_HTTP_MAX_JSON_DEPTH must be at most {MAX_JSON_DEPTH}")
    try:
        limits.proxy_networks()
    except ValueError as error:
        raise ConfigError(f"TOLLGATE_HTTP_TRUSTED_PROXIES: {error}") from None
    return limits


def _positive(name: str, default: int) -> int:
    return _above_zero(name, env_int(name, default))


def _seconds(name: str, default: float) -> float:
    return _above_zero(name, env_float(name, default))


def _above_zero(name: str, value: N) -> N:
    if value <= 0:
        raise ConfigError(f"{name} must be above 0, got {value}")
    return value


async def main(settings: AdmissionSettings) -> None:
    db = open_db(settings.common.database_url, pool_size=settings.common.db_pool_size)
    catalog = ModelCatalog.load(settings.models, settings.adapters)
    feed = RunFeed(settings.common.database_url)
    scheduler = None
    background = [
        feed.run(),
        OutboxRelay.from_settings(db, settings.common).run(),
    ]
    if settings.scheduler_address:
        scheduler = SchedulerClient(settings.scheduler_address, settings.common.internal_token)
        background.append(scheduler.watch_fleet())
    gateway = Gateway(
        db,
        catalog,
        feed,
        Canceller(EventStore(db), scheduler),
        settings.config,
        fleet=(lambda: scheduler.view) if scheduler is not None else None,
        on_queued=scheduler.hint if scheduler is not None else None,
    )
    background.append(gateway.run())
    background.append(BatchDriver(gateway, in_flight=settings.batch_in_flight).run())

    def add_servicers(server: grpc.aio.Server) -> None:
        gateway_pb2_grpc.add_GatewayServiceServicer_to_server(GatewayServicer(gateway), server)
        admin_pb2_grpc.add_AdminServiceServicer_to_server(
            AdminServicer(
                db,
                settings.admin_token,
                settings.default_max_concurrent_runs,
                failures=gateway.auth_failures,
                key_cache=gateway.key_cache,
            ),
            server,
        )

    server, port, health = create_server(settings.common.listen, add_servicers, tls=settings.tls)
    http = None
    if settings.http_listen:
        app = create_app(gateway, settings.http_limits)
        console = ConsoleSettings.from_env(settings.admin_token)
        app.include_router(console_router(gateway, console, scheduler))
        http = HttpServer(app, settings.http_listen, tls=settings.tls, limits=settings.http_limits)
    endpoints = {"http": http.url} if http is not None else {}
    if http is not None:
        background.append(http.run())
    metrics_port, metrics_tasks = start_metrics(settings.common.metrics, "admission", db)
    background.extend(metrics_tasks)
    address = bound_address(settings.common.listen, port)
    log.info(
        "serving", address=address, metrics_port=metrics_port, models=catalog.names(), **endpoints
    )
    try:
        await serve(
            server,
            health,
            SERVICES,
            background,
            address=address,
            endpoints=endpoints,
            before_stop=http.stop if http is not None else None,
        )
    finally:
        await gateway.aclose()
        if scheduler is not None:
            await scheduler.close()
        await db.dispose()
