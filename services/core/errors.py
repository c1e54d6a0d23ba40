"""API errors as values, and their translation into rich gRPC statuses.

The core raises `ApiError`s; servicers let them propagate, and `rpc_errors`
turns them into `google.rpc.Status` with the standard detail messages
(BadRequest, QuotaFailure, RetryInfo, ErrorInfo). Anything else a method raises
becomes UNAVAILABLE when the database is out of reach (clients retry), else
INTERNAL; its text, which may hold SQL and its parameters, goes to the log only.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import psycopg
import sqlalchemy.exc
import structlog
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status
from prometheus_client import Counter

ERROR_DOMAIN = "tollgate.v1"

log = structlog.get_logger(__name__)

# What the database's client raises when the server cannot be reached, a connection
# broke (the server restarted), or the pool has no connection to lend in time.
DATABASE_AWAY = (
    psycopg.OperationalError,
    psycopg.InterfaceError,
    sqlalchemy.exc.OperationalError,
    sqlalchemy.exc.InterfaceError,
    sqlalchemy.exc.TimeoutError,
)


@dataclass(frozen=True, slots=True)
class FieldViolation:
    field: str
    description: str


# The status travels in trailers, which a client refuses past its metadata limit (8 KiB by
# default in gRPC): a client would see a transport error instead of the status.
MAX_MESSAGE = 1024
MAX_VIOLATIONS = 10


class ApiError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        if len(message) > MAX_MESSAGE:
            message = message[: MAX_MESSAGE - 3] + "..."
        super().__init__(message)
        self.message = message

    def details(self) -> list[Any]:
        return []

    def to_status(self) -> status_pb2.Status:
        packed = []
        for detail in self.details():
            wrapper = any_pb2.Any()
            wrapper.Pack(detail)
            packed.append(wrapper)
        return status_pb2.Status(code=self.code.value[0], message=self.message, details=packed)


class InvalidArgument(ApiError):
    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, violations: Sequence[FieldViolation]) -> None:
        """Names the first MAX_VIOLATIONS of `violations`."""
        shown = list(violations[:MAX_VIOLATIONS])
        summary = "; ".join(f"{v.field}: {v.description}" for v in shown)
        more = len(violations) - len(shown)
        super().__init__(f"invalid request: {summary}" + (f" (and {more} more)" if more else ""))
        self.violations = shown

    def details(self) -> list[Any]:
        return [
            error_details_pb2.BadRequest(
                field_violations=[
                    error_details_pb2.BadRequest.FieldViolation(
                        field=v.field, description=v.description
                    )
                    for v in self.violations
                ]
            )
        ]


class Unauthenticated(ApiError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(ApiError):
    """The caller may not do this; `field` names the request field at fault, `reason` is
    the ErrorInfo reason (`MODEL_NOT_ALLOWED`)."""

    code = grpc.StatusCode.PERMISSION_DENIED

    def __init__(self, message: str, field: str = "", reason: str = "") -> None:
        super().__init__(message)
        self.field = field
        self.reason = reason

    def details(self) -> list[Any]:
        if not self.reason:
            return []
        metadata = {"field": self.field} if self.field else {}
        return [
            error_details_pb2.ErrorInfo(reason=self.reason, domain=ERROR_DOMAIN, metadata=metadata)
        ]


class NotFound(ApiError):
    code = grpc.StatusCode.NOT_FOUND


class QuotaExceeded(ApiError):
    """A tenant limit; `reason` is the ErrorInfo reason that names which (`STREAMS_LIMITED`)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, subject: str, retry_after: float, reason: str = "") -> None:
        super().__init__(message)
        self.subject = subject
        self.retry_after = retry_after
        self.reason = reason

    def details(self) -> list[Any]:
        violation = error_details_pb2.QuotaFailure.Violation(
            subject=self.subject, description=self.message
        )
        details: list[Any] = [
            error_details_pb2.QuotaFailure(violations=[violation]),
            _retry_info(self.retry_after),
        ]
        if self.reason:
            details.append(
                error_details_pb2.ErrorInfo(
                    reason=self.reason, domain=ERROR_DOMAIN, metadata={"subject": self.subject}
                )
            )
        return details


class ResourceExhausted(ApiError):
    """Capacity, not a tenant limit, ran out (e.g. a worker's KV blocks)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ApiError):
    code = grpc.StatusCode.UNAVAILABLE

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    def details(self) -> list[Any]:
        return [_retry_info(self.retry_after)]


class FailedPrecondition(ApiError):
    code = grpc.StatusCode.FAILED_PRECONDITION

    def __init__(self, message: str, reason: str, metadata: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.metadata = metadata or {}

    def details(self) -> list[Any]:
        return [
            error_details_pb2.ErrorInfo(
                reason=self.reason, domain=ERROR_DOMAIN, metadata=self.metadata
            )
        ]


class IdempotencyKeyReused(FailedPrecondition):
    def __init__(self, run_id: str) -> None:
        super().__init__(
            "idempotency_key already names a different request",
            "IDEMPOTENCY_KEY_REUSED",
            {"run_id": run_id},
        )


def _retry_info(seconds: float) -> error_details_pb2.RetryInfo:
    delay = duration_pb2.Duration()
    delay.FromNanoseconds(int(seconds * 1e9))
    return error_details_pb2.RetryInfo(retry_delay=delay)


F = TypeVar("F", bound=Callable[..., Any])

REJECTIONS = Counter(
    "tollgate_rpc_rejections",
    "Calls answered with an error status, by gRPC code and ErrorInfo reason (else the code)",
    ["method", "code", "reason"],
)


def count_rejection(method: str, error: ApiError) -> None:
    """Counts a refused call; `method` is the RPC, or the HTTP route's path template."""
    reason = getattr(error, "reason", "") or error.code.name
    REJECTIONS.labels(method, error.code.name, reason).inc()


async def _abort(context: Any, method: str, error: ApiError) -> None:
    count_rejection(method, error)
    await context.abort_with_status(rpc_status.to_status(error.to_status()))


def as_api_error(method: str, error: Exception) -> ApiError:
    """What the client is told of an error no ApiError describes; the details are logged."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, DATABASE_AWAY) and not _is_request_limit(error):
        log.warning("database unavailable", method=method, error=type(error).__name__)
        return Unavailable("the event store is unavailable; retry shortly", retry_after=1.0)
    log.error("unexpected error", method=method, exc_info=error)
    return ApiError("internal error")


def _is_request_limit(error: Exception) -> bool:
    """A statement past one of PostgreSQL's limits (an index row too large): its class is
    an OperationalError, but a retry fails the same way."""
    cause = getattr(error, "orig", error)
    return isinstance(cause, psycopg.errors.ProgramLimitExceeded)


def rpc_errors(method: F) -> F:
    """Aborts the call with the rich status of the error the method raises (`as_api_error`)."""
    name = method.__name__
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream(self: Any, request: Any, context: Any) -> AsyncIterator[Any]:
            try:
                async for item in method(self, request, context):
                    yield item
            except grpc.aio.AbortError:
                raise  # the method aborted the call itself
            except Exception as error:
                await _abort(context, name, as_api_error(name, error))

        return stream  # type: ignore[return-value]

    @functools.wraps(method)
    async def unary(self: Any, request: Any, context: Any) -> Any:
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as error:
            await _abort(context, name, as_api_error(name, error))

    return unary  # type: ignore[return-value]


def status_details(error: grpc.RpcError) -> list[Any]:
    """Unpacks the detail messages of a rich status error (client side)."""
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    if status is None:
        return []
    known = (
        error_details_pb2.BadRequest,
        error_details_pb2.QuotaFailure,
        error_details_pb2.RetryInfo,
        error_details_pb2.ErrorInfo,
    )
    details = []
    for packed in status.details:
        for kind in known:
            if packed.Is(kind.DESCRIPTOR):
                message = kind()
                packed.Unpack(message)
                details.append(message)
    return details


__all__ = [
    "ApiError",
    "FailedPrecondition",
    "FieldViolation",
    "IdempotencyKeyReused",
    "InvalidArgument",
    "NotFound",
    "PermissionDenied",
    "QuotaExceeded",
    "ResourceExhausted",
    "Unauthenticated",
    "Unavailable",
    "rpc_errors",
    "status_details",
]
