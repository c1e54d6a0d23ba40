"""An in-process admission server on real PostgreSQL and Kafka, without scheduler or worker.

Tests play the worker and the ledger by appending events to the store directly.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.admission.attachment_store import LEASE_SECONDS, Attachments
from services.admission.cancel import Canceller
from services.admission.catalog import ModelCatalog
from services.admission.gateway import Gateway, GatewayConfig
from services.admission.grpc.admin_servicer import AdminServicer
from services.admission.grpc.gateway_servicer import GatewayServicer
from services.admission.requests import Limits
from services.admission.stream import RunFeed
from services.admission.tenant_store import TenantStore
from services.core.db import Database, open_db
from services.core.event_store import EventStore
from services.core.pricing import PriceTable
from services.core.relay import OutboxRelay
from services.core.server import create_server
from tollgate.v1 import admin_pb2_grpc, gateway_pb2_grpc

# Streams of a revoked key end within this long here (5 s by default).
KEY_CHECK_INTERVAL = 0.2
ADMIN_TOKEN = "test-admin-token"
MODEL = "tiny"


@dataclass
class Admission:
    address: str
    channel: grpc.aio.Channel
    gateway: gateway_pb2_grpc.GatewayServiceStub
    admin: admin_pb2_grpc.AdminServiceStub
    store: EventStore
    db: Database
    tenants: TenantStore
    core: Gateway
    admin_topic: str

    async def new_tenant_key(self, name: str) -> tuple[str, str]:
        tenant = await self.tenants.create(name, 1)
        key = await self.tenants.create_key(tenant.tenant_id)
        return tenant.tenant_id, key.secret


def auth(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


@contextlib.asynccontextmanager
async def running_admission(
    database_url: str,
    kafka_bootstrap: str,
    kafka_topic: str,
    model_dir: Path,
    lease: float = LEASE_SECONDS,
    prices: PriceTable | None = None,
) -> AsyncIterator[Admission]:
    """GatewayService and AdminService on a free loopback port, with the feed and a relay
    (publishing admin events to `<kafka_topic>.admin`)."""
    admin_topic = f"{kafka_topic}.admin"
    db = open_db(database_url)
    store = EventStore(db)
    feed = RunFeed(database_url)
    gateway = Gateway(
        db,
        ModelCatalog.load({MODEL: str(model_dir)}),
        feed,
        Canceller(store, None),
        GatewayConfig(
            limits=Limits(max_tokens=512, max_message_chars=2000),
            block_size=16,
            prices=prices or PriceTable(),
            key_check_interval=KEY_CHECK_INTERVAL,
        ),
        attachments=Attachments(db, lease=lease, renew_interval=lease / 3),
    )

    def add(server: grpc.aio.Server) -> None:
        gateway_pb2_grpc.add_GatewayServiceServicer_to_server(GatewayServicer(gateway), server)
        admin_pb2_grpc.add_AdminServiceServicer_to_server(
            AdminServicer(
                db, ADMIN_TOKEN, key_cache=gateway.key_cache, failures=gateway.auth_failures
            ),
            server,
        )

    server, port, _ = create_server("127.0.0.1:0", add)
    await server.start()
    tasks = [
        asyncio.create_task(feed.run()),
        asyncio.create_task(gateway.run()),
        asyncio.create_task(
            OutboxRelay(db, kafka_bootstrap, topic=kafka_topic, admin_topic=admin_topic).run()
        ),
    ]
    await asyncio.wait_for(feed.listening.wait(), 20)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Admission(
            f"127.0.0.1:{port}",
            channel,
            gateway_pb2_grpc.GatewayServiceStub(channel),
            admin_pb2_grpc.AdminServiceStub(channel),
            store,
            db,
            # Tenants the tests make run as many runs at once as they like, unless a test
            # sets a quota; the admin API's tenants start with the default.
            TenantStore(db, default_max_concurrent_runs=0),
            gateway,
            admin_topic,
        )
    finally:
        await channel.close()
        await server.stop(0)
        try:
            await gateway.aclose()
        finally:
            for task in tasks:
                task.cancel()
            # Bounded: a task that does not stop fails the test here instead of running on
            # into later tests with its database gone.
            done, running = await asyncio.wait(tasks, timeout=30)
            assert not running, f"tasks that did not stop: {running}"
            await db.dispose()
