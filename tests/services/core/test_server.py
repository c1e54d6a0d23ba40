"""Shutdown: background tasks stop within bounded time, even one stuck in its clean-up."""

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.core.server import ServerLimits, create_server, stop_tasks


async def test_a_task_stuck_in_its_clean_up_is_cancelled_again() -> None:
    cleaned: list[str] = []

    async def stubborn() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.Event().wait()  # like a commit retried against a broker that is gone
            cleaned.append("never")

    async def polite() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            cleaned.append("polite")

    async def failed() -> None:
        raise RuntimeError("failed before shutdown")

    tasks = [asyncio.ensure_future(job()) for job in (stubborn, polite, failed)]
    await asyncio.sleep(0)
    started = time.monotonic()
    await stop_tasks(tasks, grace=0.2)
    assert time.monotonic() - started < 2
    assert all(task.done() for task in tasks)
    assert tasks[0].cancelled() and cleaned == ["polite"]


async def test_tasks_that_stop_at_once_take_no_grace() -> None:
    task = asyncio.ensure_future(asyncio.Event().wait())
    started = time.monotonic()
    await stop_tasks([task], grace=30)
    assert task.cancelled() and time.monotonic() - started < 1


async def test_calls_past_the_servers_limit_are_refused() -> None:
    server, port, health_servicer = create_server(
        "127.0.0.1:0", lambda server: None, ServerLimits(max_concurrent_rpcs=2)
    )
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            held = [stub.Watch(health_pb2.HealthCheckRequest()) for _ in range(2)]
            for call in held:
                await call.read()  # both streams are open at the server
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            held[0].cancel()
            await asyncio.sleep(0.2)
            assert (await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)).status
    finally:
        await server.stop(0)


def test_servers_keep_alive_and_age_their_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOLLGATE_MAX_CONCURRENT_RPCS", "123")
    limits = ServerLimits.from_env()
    assert limits.max_concurrent_rpcs == 123
    options = dict(limits.options())
    assert options["grpc.keepalive_time_ms"] > 0 and options["grpc.keepalive_timeout_ms"] > 0
    assert 0 < options["grpc.max_connection_idle_ms"] < options["grpc.max_connection_age_ms"]
    assert options["grpc.max_connection_age_grace_ms"] > 0
