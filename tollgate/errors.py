"""Typed exceptions for gRPC statuses and for runs that end without completing.

Every exception the SDK raises for a server answer is a `TollgateError` carrying
the status name (`code`, e.g. "INVALID_ARGUMENT"), the server's `message` and the
unpacked `google.rpc` detail messages (`details`).
"""

from __future__ import annotations

from typing import Any

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

IDEMPOTENCY_KEY_REUSED = "IDEMPOTENCY_KEY_REUSED"

_DETAIL_TYPES = (
    error_details_pb2.BadRequest,
    error_details_pb2.QuotaFailure,
    error_details_pb2.RetryInfo,
    error_details_pb2.ErrorInfo,
    error_details_pb2.PreconditionFailure,
    error_details_pb2.ResourceInfo,
)


class TollgateError(Exception):
    """Base of every SDK error."""

    def __init__(
        self,
        code: str,
        message: str,
        details: list[Any] | None = None,
        status_code: grpc.StatusCode | None = None,
    ) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.details = list(details or [])
        self.status_code = status_code

    def summary(self) -> str:
        """A one-line description: the status name and what went wrong."""
        return f"{self.code}: {self.message}"


class InvalidArgumentError(TollgateError):
    """INVALID_ARGUMENT; `field_violations` lists (field, description) pairs."""

    @property
    def field_violations(self) -> list[tuple[str, str]]:
        return [
            (v.field, v.description)
            for d in self.details
            if isinstance(d, error_details_pb2.BadRequest)
            for v in d.field_violations
        ]

    def summary(self) -> str:
        violations = self.field_violations
        if not violations:
            return super().summary()
        return f"{self.code}: " + "; ".join(f"{f}: {d}" for f, d in violations)


class UnauthenticatedError(TollgateError):
    """UNAUTHENTICATED: a missing, unknown or revoked key or token."""


class PermissionDeniedError(TollgateError):
    """PERMISSION_DENIED."""


class NotFoundError(TollgateError):
    """NOT_FOUND, also for another tenant's run."""


class _RetryAfter(TollgateError):
    @property
    def retry_after(self) -> float | None:
        """Seconds the server asks to wait before trying again (RetryInfo), if it said."""
        for d in self.details:
            if isinstance(d, error_details_pb2.RetryInfo):
                return d.retry_delay.ToNanoseconds() / 1e9
        return None

    def summary(self) -> str:
        after = self.retry_after
        suffix = f" (retry after {after:g}s)" if after is not None else ""
        return super().summary() + suffix


class QuotaExceededError(_RetryAfter):
    """RESOURCE_EXHAUSTED: a tenant limit; `violations` lists (subject, description),
    `reason` says which kind (`RATE_LIMITED`, `BUDGET_EXCEEDED`, `CONCURRENCY_LIMITED`,
    `KV_LIMITED`, `STREAMS_LIMITED`) and `retry_after` when enough is free again."""

    @property
    def reason(self) -> str:
        for d in self.details:
            if isinstance(d, error_details_pb2.ErrorInfo):
                return d.reason
        return ""

    @property
    def violations(self) -> list[tuple[str, str]]:
        return [
            (v.subject, v.description)
            for d in self.details
            if isinstance(d, error_details_pb2.QuotaFailure)
            for v in d.violations
        ]


class UnavailableError(_RetryAfter):
    """UNAVAILABLE: overload, draining or a broken connection."""


class DeadlineExceededError(TollgateError):
    """DEADLINE_EXCEEDED."""


class FailedPreconditionError(TollgateError):
    """FAILED_PRECONDITION; `reason` and `metadata` come from ErrorInfo when present."""

    def _info(self) -> error_details_pb2.ErrorInfo | None:
        for d in self.details:
            if isinstance(d, error_details_pb2.ErrorInfo):
                return d
        return None

    @property
    def reason(self) -> str:
        info = self._info()
        return info.reason if info else ""

    @property
    def metadata(self) -> dict[str, str]:
        info = self._info()
        return dict(info.metadata) if info else {}


class IdempotencyKeyReusedError(FailedPreconditionError):
    """The idempotency key already names a different request; `run_id` names that run."""

    @property
    def run_id(self) -> str:
        return self.metadata.get("run_id", "")


class StreamGapError(TollgateError):
    """A run's events arrived with a gap that reconnecting did not fill: in `seq`, or in
    the run's output (`expected_at`, `got_at`: tokens and characters of text before)."""

    def __init__(
        self,
        run_id: str,
        expected_seq: int,
        got_seq: int,
        expected_at: tuple[int, int] | None = None,
        got_at: tuple[int, int] | None = None,
    ) -> None:
        where = f"event seq {expected_seq}, got {got_seq}"
        if expected_at is not None:
            where = f"output from {expected_at} after event seq {expected_seq}, got {got_at}"
        super().__init__("DATA_LOSS", f"run {run_id}: expected {where}")
        self.run_id = run_id
        self.expected_seq = expected_seq
        self.got_seq = got_seq
        self.expected_at = expected_at
        self.got_at = got_at


class RunFailedError(TollgateError):
    """A run ended `failed`; `code` is the failure code, e.g. "WORKER_LOST"."""

    def __init__(self, run_id: str, code: str, message: str) -> None:
        super().__init__(code or "FAILED", f"run {run_id} failed: {message}")
        self.run_id = run_id


class RunCancelledError(TollgateError):
    """A run ended `cancelled`."""

    def __init__(self, run_id: str, reason: str) -> None:
        super().__init__("CANCELLED", f"run {run_id} cancelled" + (f": {reason}" if reason else ""))
        self.run_id = run_id
        self.reason = reason


_BY_CODE: dict[grpc.StatusCode, type[TollgateError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: QuotaExceededError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
}


def unpack_details(error: grpc.RpcError) -> list[Any]:
    """The google.rpc detail messages of a rich status error (works for grpc.aio too)."""
    try:
        status = rpc_status.from_call(error)  # type: ignore[arg-type]
    except ValueError:
        # The trailer disagrees with the status line: trust the status line alone.
        return []
    if status is None:
        return []
    details: list[Any] = []
    for packed in status.details:
        for kind in _DETAIL_TYPES:
            if packed.Is(kind.DESCRIPTOR):
                message = kind()
                packed.Unpack(message)
                details.append(message)
    return details


def from_rpc_error(error: grpc.RpcError) -> TollgateError:
    """The typed exception for a failed gRPC call."""
    status_code: grpc.StatusCode = error.code()  # type: ignore[attr-defined]
    message: str = error.details() or ""  # type: ignore[attr-defined]
    details = unpack_details(error)
    kind = _BY_CODE.get(status_code, TollgateError)
    if kind is FailedPreconditionError and any(
        isinstance(d, error_details_pb2.ErrorInfo) and d.reason == IDEMPOTENCY_KEY_REUSED
        for d in details
    ):
        kind = IdempotencyKeyReusedError
    return kind(status_code.name, message, details, status_code)
