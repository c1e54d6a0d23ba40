"""Whether a service process serves: the standard gRPC health check at its address."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

CHECK_TIMEOUT_S = 0.5


def is_serving(address: str, timeout: float = CHECK_TIMEOUT_S) -> bool:
    """True when the plaintext server at `address` answers the health check SERVING."""
    # A channel of its own each time: a channel that failed to connect waits out a
    # reconnect backoff before it tries again, and would see the server late.
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout
            )
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
