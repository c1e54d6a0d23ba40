"""API errors as values: what a client is told, with no protocol in it.

The core raises `ApiError`s. Each names its status as gRPC's canonical code name
(`INVALID_ARGUMENT`, ...), which both front doors translate: `services.core.grpc_errors`
into a rich `google.rpc.Status`, admission's HTTP door into an HTTP status and an OpenAI
error body. `as_api_error` says what a client is told of any other exception: UNAVAILABLE
when the database is out of reach (clients retry), else INTERNAL, whose text, which may
hold SQL and its parameters, goes to the log only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import psycopg
import sqlalchemy.exc
import structlog
from prometheus_client import Counter

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
    # The canonical status code's name, as gRPC spells it.
    code: str = "INTERNAL"

    def __init__(self, message: str) -> None:
        if len(message) > MAX_MESSAGE:
            message = message[: MAX_MESSAGE - 3] + "..."
        super().__init__(message)
        self.message = message


class InvalidArgument(ApiError):
    code = "INVALID_ARGUMENT"

    def __init__(self, violations: Sequence[FieldViolation]) -> None:
        """Names the first MAX_VIOLATIONS of `violations`."""
        shown = list(violations[:MAX_VIOLATIONS])
        summary = "; ".join(f"{v.field}: {v.description}" for v in shown)
        more = len(violations) - len(shown)
        super().__init__(f"invalid request: {summary}" + (f" (and {more} more)" if more else ""))
        self.violations = shown


class Unauthenticated(ApiError):
    code = "UNAUTHENTICATED"


class PermissionDenied(ApiError):
    """The caller may not do this; `field` names the request field at fault, `reason` is
    the ErrorInfo reason (`MODEL_NOT_ALLOWED`)."""

    code = "PERMISSION_DENIED"

    def __init__(self, message: str, field: str = "", reason: str = "") -> None:
        super().__init__(message)
        self.field = field
        self.reason = reason


class NotFound(ApiError):
    code = "NOT_FOUND"


class QuotaExceeded(ApiError):
    """A tenant limit; `reason` is the ErrorInfo reason that names which (`STREAMS_LIMITED`)."""

    code = "RESOURCE_EXHAUSTED"

    def __init__(self, message: str, subject: str, retry_after: float, reason: str = "") -> None:
        super().__init__(message)
        self.subject = subject
        self.retry_after = retry_after
        self.reason = reason


class ResourceExhausted(ApiError):
    """Capacity, not a tenant limit, ran out (e.g. a worker's KV blocks)."""

    code = "RESOURCE_EXHAUSTED"


class Unavailable(ApiError):
    code = "UNAVAILABLE"

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class FailedPrecondition(ApiError):
    code = "FAILED_PRECONDITION"

    def __init__(self, message: str, reason: str, metadata: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.metadata = metadata or {}


class IdempotencyKeyReused(FailedPrecondition):
    def __init__(self, run_id: str) -> None:
        super().__init__(
            "idempotency_key already names a different request",
            "IDEMPOTENCY_KEY_REUSED",
            {"run_id": run_id},
        )


REJECTIONS = Counter(
    "tollgate_rpc_rejections",
    "Calls answered with an error status, by gRPC code and ErrorInfo reason (else the code)",
    ["method", "code", "reason"],
)


def count_rejection(method: str, error: ApiError) -> None:
    """Counts a refused call; `method` is the RPC, or the HTTP route's path template."""
    reason = getattr(error, "reason", "") or error.code
    REJECTIONS.labels(method, error.code, reason).inc()


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
