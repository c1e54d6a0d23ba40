"""What the asyncio client and its generated synchronous form share as written.

`tollgate/aio.py` and `tollgate/aio_stream.py` are the one source of both clients;
`tools/sdkgen.py` turns them into `tollgate/client.py` and `tollgate/stream.py` by
dropping `async`/`await` and renaming `Async*` to `Sync*` (or the names its table
gives). What cannot be renamed token by token lives here in both forms: the
channel (`grpc.aio` against `grpc`) and the callables whose result is awaited.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc

from tollgate.types import ChatMessage, RetryPolicy, Run

T = TypeVar("T")

DEFAULT_TIMEOUT = 30.0
DEFAULT_RETRY = RetryPolicy()

Messages = Sequence[ChatMessage | tuple[str, str] | Mapping[str, Any]]

# A stub's unary method, its answer awaited or not.
AsyncUnary = Callable[..., Awaitable[T]]
SyncUnary = Callable[..., T]

# What a stream waits with between attempts.
AsyncSleep = Callable[[float], Awaitable[None]]
SyncSleep = Callable[[float], None]

# Asks the server how a run stands (the client's get_run).
AsyncProbe = Callable[[str], Awaitable[Run]]
SyncProbe = Callable[[str], Run]


def bearer(secret: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {secret}"),)


# Gateway addresses: one `host:port`, several comma-separated, or a sequence of them.
Addresses = str | Sequence[str]

# PEM root certificates: their bytes, or the path of a file holding them.
RootCertificates = bytes | str | os.PathLike[str]


def channel_credentials(
    credentials: grpc.ChannelCredentials | None, root_certificates: RootCertificates | None
) -> grpc.ChannelCredentials | None:
    """TLS credentials trusting `root_certificates`, else `credentials` as given (None:
    plaintext). Both at once is ambiguous, so refused."""
    if root_certificates is None:
        return credentials
    if credentials is not None:
        raise ValueError("pass credentials or root_certificates, not both")
    pem = (
        root_certificates
        if isinstance(root_certificates, bytes)
        else Path(root_certificates).read_bytes()
    )
    return grpc.ssl_channel_credentials(root_certificates=pem)


def open_channel(
    address: Addresses,
    credentials: grpc.ChannelCredentials | None,
    options: Sequence[tuple[str, Any]],
) -> grpc.Channel:
    """A channel for the synchronous client: TLS with `credentials`, plaintext without."""
    return _open(grpc, address, credentials, options)


def open_async_channel(
    address: Addresses,
    credentials: grpc.ChannelCredentials | None,
    options: Sequence[tuple[str, Any]],
) -> grpc.aio.Channel:
    """The same for the asyncio client."""
    return _open(grpc.aio, address, credentials, options)


def _open(
    module: Any,
    address: Addresses,
    credentials: grpc.ChannelCredentials | None,
    options: Sequence[tuple[str, Any]],
) -> Any:
    target, balancing = channel_target(address)
    options = [*balancing, *options]
    # `grpc` and `grpc.aio` spell both channel constructors alike.
    if credentials is None:
        return module.insecure_channel(target, options=options)
    return module.secure_channel(target, credentials, options=options)


def split_addresses(address: Addresses) -> list[str]:
    parts = address.split(",") if isinstance(address, str) else list(address)
    return [part.strip() for part in parts if part.strip()]


def channel_target(address: Addresses) -> tuple[str, list[tuple[str, Any]]]:
    """The channel target for `address`, and the options that balance it.

    One address is used as it is. Several become one target of their IP addresses that
    gRPC's round_robin policy spreads calls over: each call goes to a gateway that is
    connected, so a call retried after UNAVAILABLE (a resume) reaches another gateway
    while the one that failed is down.
    """
    addresses = split_addresses(address)
    if len(addresses) == 1:
        return addresses[0], []
    if not addresses:
        raise ValueError("no gateway address")
    resolved = [_resolve(a) for a in addresses]
    family = "ipv6" if all(ip.startswith("[") for ip in resolved) else "ipv4"
    # A target lists addresses of one family; a name that has both resolves to both.
    chosen = [ip for ip in resolved if ip.startswith("[") == (family == "ipv6")]
    if not chosen:
        raise ValueError(f"gateway addresses of mixed families: {address!r}")
    authority = addresses[0]
    return f"{family}:{','.join(chosen)}", [
        ("grpc.lb_policy_name", "round_robin"),
        # TLS checks the certificate against the name the caller gave, not an IP.
        ("grpc.default_authority", authority),
    ]


def _resolve(address: str) -> str:
    """`host:port` as `ip:port` (`[ip6]:port`)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"gateway address {address!r} is not host:port")
    host = host.strip("[]")
    family, *_, sockaddr = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)[0]
    ip = str(sockaddr[0])
    return f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"
