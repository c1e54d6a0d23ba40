"""What the asyncio client and its generated synchronous form share as written.

`tollgate/aio.py` and `tollgate/aio_stream.py` are the one source of both clients;
`tools/sdkgen.py` turns them into `tollgate/client.py` and `tollgate/stream.py` by
dropping `async`/`await` and renaming `Async*` to `Sync*` (or the names its table
gives). What cannot be renamed token by token lives here in both forms: the
channel (`grpc.aio` against `grpc`) and the callables whose result is awaited.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc

from tollgate.types import ChatMessage, RetryPolicy, Run

T = TypeVar("T")

DEFAULT_TIMEOUT = 30.0
DEFAULT_RETRY = RetryPolicy()

Messages = Sequence[ChatMessage | tuple[str, str] | dict[str, str]]

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


def open_channel(
    address: str, credentials: grpc.ChannelCredentials | None, options: Sequence[tuple[str, Any]]
) -> grpc.Channel:
    """A channel for the synchronous client: TLS with `credentials`, plaintext without."""
    return _open(grpc, address, credentials, options)


def open_async_channel(
    address: str, credentials: grpc.ChannelCredentials | None, options: Sequence[tuple[str, Any]]
) -> grpc.aio.Channel:
    """The same for the asyncio client."""
    return _open(grpc.aio, address, credentials, options)


def _open(
    module: Any,
    address: str,
    credentials: grpc.ChannelCredentials | None,
    options: Sequence[tuple[str, Any]],
) -> Any:
    # `grpc` and `grpc.aio` spell both channel constructors alike.
    if credentials is None:
        return module.insecure_channel(address, options=list(options))
    return module.secure_channel(address, credentials, options=list(options))
