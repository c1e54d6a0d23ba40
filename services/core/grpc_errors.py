"""API errors as rich gRPC statuses: the servicers' side of `services.core.errors`.

`rpc_errors` wraps a servicer method so that whatever it raises ends the call with a
`google.rpc.Status` carrying the standard detail messages (BadRequest, QuotaFailure,
RetryInfo, ErrorInfo); an exception no ApiError describes is told as `as_api_error` says.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf import any_pb2, duration_pb2, message
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from services.core.errors import (
    ApiError,
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    QuotaExceeded,
    Unavailable,
    as_api_error,
    count_rejection,
)

ERROR_DOMAIN = "tollgate.v1"

F = TypeVar("F", bound=Callable[..., Any])


def to_status(error: ApiError) -> status_pb2.Status:
    packed = []
    for detail in details(error):
        wrapper = any_pb2.Any()
        wrapper.Pack(detail)
        packed.append(wrapper)
    code = grpc.StatusCode[error.code].value[0]
    return status_pb2.Status(code=code, message=error.message, details=packed)


def details(error: ApiError) -> list[message.Message]:
    """The google.rpc detail messages that tell a client what to do about `error`."""
    if isinstance(error, InvalidArgument):
        violations = [
            error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description)
            for v in error.violations
        ]
        return [error_details_pb2.BadRequest(field_violations=violations)]
    if isinstance(error, QuotaExceeded):
        violation = error_details_pb2.QuotaFailure.Violation(
            subject=error.subject, description=error.message
        )
        found: list[message.Message] = [
            error_details_pb2.QuotaFailure(violations=[violation]),
            _retry_info(error.retry_after),
        ]
        if error.reason:
            found.append(_error_info(error.reason, {"subject": error.subject}))
        return found
    if isinstance(error, Unavailable):
        return [_retry_info(error.retry_after)]
    if isinstance(error, FailedPrecondition):
        return [_error_info(error.reason, error.metadata)]
    if isinstance(error, PermissionDenied) and error.reason:
        return [_error_info(error.reason, {"field": error.field} if error.field else {})]
    return []


def _error_info(reason: str, metadata: dict[str, str]) -> error_details_pb2.ErrorInfo:
    return error_details_pb2.ErrorInfo(reason=reason, domain=ERROR_DOMAIN, metadata=metadata)


def _retry_info(seconds: float) -> error_details_pb2.RetryInfo:
    delay = duration_pb2.Duration()
    delay.FromNanoseconds(int(seconds * 1e9))
    return error_details_pb2.RetryInfo(retry_delay=delay)


async def _abort(context: Any, method: str, error: ApiError) -> None:
    count_rejection(method, error)
    await context.abort_with_status(rpc_status.to_status(to_status(error)))


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
