"""Tollgate client SDK and command line.

    from tollgate import Client
    with Client("localhost:50051", api_key) as client:
        print(client.generate_text("Hello", model="tiny", max_tokens=16))

Names are imported on first use, so tools that only need the generated
`tollgate.v1` modules do not load the client.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Client": "tollgate.client",
    "AdminClient": "tollgate.client",
    "AsyncClient": "tollgate.aio",
    "AsyncAdminClient": "tollgate.aio",
    "Stream": "tollgate.stream",
    "AsyncStream": "tollgate.aio_stream",
    "RetryPolicy": "tollgate.types",
    "RunEvent": "tollgate.types",
    "Run": "tollgate.types",
    "Usage": "tollgate.types",
    "ChatMessage": "tollgate.types",
    "ToolCall": "tollgate.types",
    "TokenLogprob": "tollgate.types",
    "TopLogprob": "tollgate.types",
    "TollgateError": "tollgate.errors",
    "InvalidArgumentError": "tollgate.errors",
    "UnauthenticatedError": "tollgate.errors",
    "NotFoundError": "tollgate.errors",
    "QuotaExceededError": "tollgate.errors",
    "UnavailableError": "tollgate.errors",
    "FailedPreconditionError": "tollgate.errors",
    "IdempotencyKeyReusedError": "tollgate.errors",
    "RunFailedError": "tollgate.errors",
    "RunCancelledError": "tollgate.errors",
}

if TYPE_CHECKING:
    from tollgate.aio import AsyncAdminClient, AsyncClient
    from tollgate.aio_stream import AsyncStream
    from tollgate.client import AdminClient, Client
    from tollgate.errors import (
        FailedPreconditionError,
        IdempotencyKeyReusedError,
        InvalidArgumentError,
        NotFoundError,
        QuotaExceededError,
        RunCancelledError,
        RunFailedError,
        TollgateError,
        UnauthenticatedError,
        UnavailableError,
    )
    from tollgate.stream import Stream
    from tollgate.types import (
        ChatMessage,
        RetryPolicy,
        Run,
        RunEvent,
        TokenLogprob,
        ToolCall,
        TopLogprob,
        Usage,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tollgate' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "AdminClient",
    "AsyncAdminClient",
    "AsyncClient",
    "AsyncStream",
    "ChatMessage",
    "Client",
    "FailedPreconditionError",
    "IdempotencyKeyReusedError",
    "InvalidArgumentError",
    "NotFoundError",
    "QuotaExceededError",
    "RetryPolicy",
    "Run",
    "RunCancelledError",
    "RunEvent",
    "RunFailedError",
    "Stream",
    "TokenLogprob",
    "TollgateError",
    "ToolCall",
    "TopLogprob",
    "UnauthenticatedError",
    "UnavailableError",
    "Usage",
]
