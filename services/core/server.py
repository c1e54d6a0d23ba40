"""The life of a service process: gRPC server, health, tracing, SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.core import loop
from services.core.config import ConfigError, env_int
from services.core.telemetry import configure_logging, configure_tracing
from services.core.tls import ServerTls

log = structlog.get_logger(__name__)

S = TypeVar("S")


def run_service(
    name: str, load_settings: Callable[[], S], main: Callable[[S], Coroutine[Any, Any, None]]
) -> None:
    """`python -m services.<name>`: logs and traces set up, settings read from the
    environment (a bad one exits with status 2, naming the variable), then `main` on the
    configured event loop until it returns."""
    configure_logging(name)
    try:
        configure_tracing(name)
        loop.run(main(load_settings()))
    except ConfigError as error:
        log.error("bad configuration", error=str(error))
        print(f"{name}: {error}", file=sys.stderr)
        sys.exit(2)


def bound_address(listen: str, port: int) -> str:
    """`host:port` of a server bound to `listen` (whose port may be 0) on `port`."""
    host = listen.rpartition(":")[0] or "127.0.0.1"
    return f"{host}:{port}"


def announce(address: str, endpoints: Mapping[str, str] | None = None) -> None:
    """Tells the launcher the bound address, and any other `endpoints` (name → URL): it
    reads this line when the port was 0."""
    extra = "".join(f" {name}={url}" for name, url in (endpoints or {}).items())
    print(f"READY {address}{extra}", flush=True)


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """What one server takes from its clients, whoever they are.

    Calls past `max_concurrent_rpcs` are refused by gRPC itself (RESOURCE_EXHAUSTED)
    before any servicer runs. Keepalive pings find a client gone without a word (its
    streams then end and release what they hold); idle connections are closed; every
    connection is closed after `max_connection_age_ms` (its streams get the grace to
    finish, then resume elsewhere), so clients spread over replicas as they come and go.
    """

    max_concurrent_rpcs: int = 10_000
    max_receive_message_length: int = 16 * 1024 * 1024
    keepalive_time_ms: int = 60_000
    keepalive_timeout_ms: int = 20_000
    # Client pings more frequent than this, without data, are answered with GOAWAY.
    min_client_ping_interval_ms: int = 10_000
    max_connection_idle_ms: int = 5 * 60_000
    max_connection_age_ms: int = 30 * 60_000
    max_connection_age_grace_ms: int = 10 * 60_000

    @classmethod
    def from_env(cls) -> ServerLimits:
        return cls(max_concurrent_rpcs=env_int("TOLLGATE_MAX_CONCURRENT_RPCS", 10_000))

    def options(self) -> list[tuple[str, int]]:
        return [
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", self.max_receive_message_length),
            ("grpc.keepalive_time_ms", self.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", self.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", self.min_client_ping_interval_ms),
            ("grpc.http2.max_ping_strikes", 2),
            ("grpc.max_connection_idle_ms", self.max_connection_idle_ms),
            ("grpc.max_connection_age_ms", self.max_connection_age_ms),
            ("grpc.max_connection_age_grace_ms", self.max_connection_age_grace_ms),
        ]


def create_server(
    listen: str,
    add_servicers: Callable[[grpc.aio.Server], None],
    limits: ServerLimits | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    tls: ServerTls | None = None,
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """A grpc.aio server with the standard health service, within `limits` (by default
    those of the environment), speaking TLS with `tls`; returns it with its port."""
    limits = limits or ServerLimits.from_env()
    server = grpc.aio.server(
        options=limits.options(),
        maximum_concurrent_rpcs=limits.max_concurrent_rpcs,
        interceptors=list(interceptors),
    )
    add_servicers(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if tls is None:
        port = server.add_insecure_port(listen)
    else:
        port = server.add_secure_port(listen, tls.server_credentials())
    if port == 0:
        raise OSError(f"cannot listen on {listen}")
    return server, port, health_servicer


async def set_serving(
    health_servicer: health.aio.HealthServicer, services: Sequence[str], serving: bool
) -> None:
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for name in ("", *services):
        await health_servicer.set(name, status)


async def wait_for_signal() -> None:
    """Returns on the first SIGTERM or SIGINT."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def serve(
    server: grpc.aio.Server,
    health_servicer: health.aio.HealthServicer,
    services: Sequence[str],
    background: Sequence[Awaitable[None]] = (),
    *,
    grace: float = 5.0,
    before_stop: Callable[[], Awaitable[None]] | None = None,
    address: str | None = None,
    endpoints: Mapping[str, str] | None = None,
) -> None:
    """Runs until SIGTERM/SIGINT, then drains: not serving, stop with grace, cancel tasks.

    `address`, when given, is announced once the server serves, with `endpoints`."""
    await server.start()
    await set_serving(health_servicer, services, True)
    if address is not None:
        announce(address, endpoints)
    log.info("running", event_loop=loop.running_loop_name())
    tasks = [asyncio.ensure_future(job) for job in background]
    signalled = asyncio.ensure_future(wait_for_signal())
    await asyncio.wait([signalled, *tasks], return_when=asyncio.FIRST_COMPLETED)
    for task in tasks:
        if task.done() and task.exception() is not None:
            log.error("background task failed", error=repr(task.exception()))
    log.info("shutting down", grace_seconds=grace)
    await set_serving(health_servicer, services, False)
    if before_stop is not None:
        await before_stop()
    await server.stop(grace)
    await stop_tasks([*tasks, signalled], grace)


async def stop_tasks(tasks: Sequence[asyncio.Future[Any]], grace: float) -> None:
    """Cancels `tasks` and waits up to `grace` seconds for them.

    A task still running then is stuck in its clean-up (a Kafka client committing
    offsets to a broker that is gone retries without end): it is cancelled once
    more, which interrupts that, and given `grace` again.
    """
    pending = set(tasks)
    for attempt in range(2):
        if not pending:
            break
        if attempt:
            log.warning(
                "background tasks still stopping, cancelling again", num_pending=len(pending)
            )
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=grace)
    if pending:
        log.error("background tasks did not stop", tasks=[repr(task) for task in pending])
    for task in tasks:
        if task.done() and not task.cancelled():
            task.exception()  # retrieved, so asyncio does not report it again
