"""`tollgate health ADDRESS`: ask a Tollgate process whether it serves (grpc.health.v1).

Exit status 0 when SERVING, 1 otherwise: fit for container health checks.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tollgate.commands.connection import TLS_CA_ENV, TLS_CA_HELP
from tollgate.transport import channel_credentials, open_channel


def register(subparsers: Any) -> None:
    """Adds `health` to the `tollgate` command line."""
    health = subparsers.add_parser("health", help="check a process's gRPC health service")
    health.add_argument("address", help="host:port")
    health.add_argument("--service", default="", help="service name (default: the whole server)")
    health.add_argument("--timeout", type=float, default=3.0, help="seconds (default: 3)")
    health.add_argument("--tls-ca", help=TLS_CA_HELP)
    health.set_defaults(func=health_command)


def health_command(args: argparse.Namespace) -> int:
    request = health_pb2.HealthCheckRequest(service=args.service)
    credentials = channel_credentials(None, args.tls_ca or os.environ.get(TLS_CA_ENV))
    with open_channel(args.address, credentials, ()) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = stub.Check(request, timeout=args.timeout, wait_for_ready=True)
        except grpc.RpcError as error:
            print(f"error: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    print(status)
    return 0 if response.status == health_pb2.HealthCheckResponse.SERVING else 1
