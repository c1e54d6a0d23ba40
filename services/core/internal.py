"""The internal credential: a shared token (`TOLLGATE_INTERNAL_TOKEN`) that every call to an
internal service (the scheduler's, the worker's) carries as `authorization: Bearer`, and
without which those services answer UNAUTHENTICATED. So nobody on the network can cancel
another tenant's run or register a worker that would then be sent other tenants' prompts.

Without a token set the internal services are open, as for a process started by hand on a
developer's machine; `tollgate up` always generates one, and compose requires one.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Collection
from typing import Any

import grpc
import structlog

log = structlog.get_logger(__name__)

INTERNAL_TOKEN_ENV = "TOLLGATE_INTERNAL_TOKEN"


def is_internal_token(metadata: Any, token: str) -> bool:
    for name, value in metadata or ():
        if name.lower() == "authorization":
            text = value.decode() if isinstance(value, bytes) else value
            scheme, _, given = text.partition(" ")
            return scheme.lower() == "bearer" and hmac.compare_digest(
                given.strip().encode(), token.encode()
            )
    return False


class InternalAuth(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuses calls to `services` (full names) that lack the token; others pass."""

    def __init__(self, token: str, services: Collection[str]) -> None:
        self.token = token
        self.prefixes = tuple(f"/{name}/" for name in services)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = details.method or ""
        if not method.startswith(self.prefixes) or is_internal_token(
            details.invocation_metadata, self.token
        ):
            return await continuation(details)
        log.warning("internal call without the internal token refused", method=method)
        return _refusal(await continuation(details))


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that answers UNAUTHENTICATED."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong internal token")

    async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await refuse(request, context)
        yield  # pragma: no cover

    make = (
        grpc.unary_stream_rpc_method_handler
        if handler.response_streaming
        else (grpc.unary_unary_rpc_method_handler)
    )
    return make(
        refuse_stream if handler.response_streaming else refuse,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def server_interceptors(token: str, services: Collection[str]) -> list[InternalAuth]:
    if not token:
        log.warning(f"{INTERNAL_TOKEN_ENV} is not set: the internal services take any caller")
        return []
    return [InternalAuth(token, services)]


class _WithToken(
    grpc.aio.UnaryUnaryClientInterceptor,  # type: ignore[misc]
    grpc.aio.UnaryStreamClientInterceptor,  # type: ignore[misc]
):
    def __init__(self, token: str) -> None:
        self.header = ("authorization", f"Bearer {token}")

    def _with_token(self, details: Any) -> Any:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self.header)
        return details._replace(metadata=metadata)

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._with_token(details), request)

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._with_token(details), request)


def internal_channel(address: str, token: str) -> grpc.aio.Channel:
    """A channel to an internal service whose calls carry `token` (none when empty)."""
    interceptors = [_WithToken(token)] if token else None
    return grpc.aio.insecure_channel(address, interceptors=interceptors)
