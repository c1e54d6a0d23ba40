"""The internal credential: an internal service answers only calls that carry the token,
an internal channel sends it on every call, and health checks stay open."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.core.internal import internal_channel, server_interceptors
from services.core.server import create_server
from tollgate.v1 import scheduler_pb2, scheduler_pb2_grpc

TOKEN = "internal-secret"
SERVICE = scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"].full_name


async def queue_stats(
    request: scheduler_pb2.GetQueueStatsRequest, context: grpc.aio.ServicerContext
) -> scheduler_pb2.QueueStats:
    return scheduler_pb2.QueueStats()


@pytest.fixture
async def address() -> AsyncIterator[str]:
    handler = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "GetQueueStats": grpc.unary_unary_rpc_method_handler(
                queue_stats,
                request_deserializer=scheduler_pb2.GetQueueStatsRequest.FromString,
                response_serializer=scheduler_pb2.QueueStats.SerializeToString,
            )
        },
    )
    server, port, _ = create_server(
        "127.0.0.1:0",
        lambda s: s.add_generic_rpc_handlers([handler]),
        interceptors=server_interceptors(TOKEN, [SERVICE]),
    )
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


async def code_of(channel: grpc.aio.Channel) -> grpc.StatusCode:
    stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
    try:
        await stub.GetQueueStats(scheduler_pb2.GetQueueStatsRequest(), timeout=10)
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


async def test_only_calls_with_the_token_are_answered(address: str) -> None:
    async with internal_channel(address, TOKEN) as channel:
        assert await code_of(channel) == grpc.StatusCode.OK
    for token in ("", "wrong", TOKEN + "x"):
        async with internal_channel(address, token) as channel:
            assert await code_of(channel) == grpc.StatusCode.UNAUTHENTICATED


async def test_health_checks_need_no_token(address: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_without_a_token_the_services_are_open() -> None:
    assert server_interceptors("", [SERVICE]) == []
