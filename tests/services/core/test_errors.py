"""What a client is told when a servicer method raises."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import psycopg
import pytest
import sqlalchemy.exc
from google.rpc import status_pb2

from services.core.errors import (
    MAX_MESSAGE,
    MAX_VIOLATIONS,
    FieldViolation,
    InvalidArgument,
    NotFound,
)
from services.core.grpc_errors import rpc_errors


class Aborted(Exception):
    def __init__(self, status: Any) -> None:
        self.status = status


class FakeContext:
    """Records the status a call is aborted with, as grpc.aio's context would."""

    async def abort_with_status(self, status: Any) -> None:
        raise Aborted(status)


def aborted_with(error: BaseException, streaming: bool) -> tuple[grpc.StatusCode, str, list[str]]:
    async def unary(self: object, request: object, context: object) -> None:
        raise error

    async def stream(self: object, request: object, context: object) -> AsyncIterator[int]:
        yield 1
        raise error

    async def call() -> None:
        if streaming:
            async for _ in rpc_errors(stream)(None, None, FakeContext()):
                pass
        else:
            await rpc_errors(unary)(None, None, FakeContext())

    with pytest.raises(Aborted) as caught:
        asyncio.run(call())
    status = caught.value.status
    detail = status_pb2.Status.FromString(status.trailing_metadata[0][1])
    kinds = [d.type_url.rsplit(".", 1)[-1] for d in detail.details]
    return status.code, status.details, kinds


DATABASE_AWAY = [
    psycopg.OperationalError("terminating connection due to administrator command"),
    sqlalchemy.exc.OperationalError("SELECT secret FROM t", {"p": "x"}, Exception("gone")),
    sqlalchemy.exc.InterfaceError("SELECT 1", {}, Exception("closed")),
    sqlalchemy.exc.TimeoutError("QueuePool limit reached"),
]


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("error", DATABASE_AWAY, ids=lambda e: type(e).__module__)
def test_a_database_out_of_reach_is_unavailable_with_a_retry_delay(
    error: Exception, streaming: bool
) -> None:
    code, message, details = aborted_with(error, streaming)
    assert code == grpc.StatusCode.UNAVAILABLE
    assert message == "the event store is unavailable; retry shortly"
    assert details == ["RetryInfo"]


@pytest.mark.parametrize("streaming", [False, True])
def test_anything_else_is_internal_and_its_text_stays_in_the_log(streaming: bool) -> None:
    error = sqlalchemy.exc.ProgrammingError("SELECT prompt FROM x", {"p": "my prompt"}, Exception())
    code, message, _ = aborted_with(error, streaming)
    assert code == grpc.StatusCode.INTERNAL
    assert message == "internal error"
    code, message, _ = aborted_with(KeyError("prompt"), streaming)
    assert (code, message) == (grpc.StatusCode.INTERNAL, "internal error")


def test_api_errors_keep_their_status_and_aborts_pass_through() -> None:
    assert aborted_with(NotFound("run r does not exist"), False)[:2] == (
        grpc.StatusCode.NOT_FOUND,
        "run r does not exist",
    )
    with pytest.raises(grpc.aio.AbortError):
        aborted_with(grpc.aio.AbortError(), False)


@pytest.mark.parametrize("streaming", [False, True])
def test_a_statement_past_a_database_limit_is_not_retryable(streaming: bool) -> None:
    # What PostgreSQL says of an index row too large: a retry fails the same way.
    cause = psycopg.errors.ProgramLimitExceeded("index row size 4016 exceeds maximum 2704")
    for error in (cause, sqlalchemy.exc.OperationalError("INSERT", {}, cause)):
        code, message, _ = aborted_with(error, streaming)
        assert (code, message) == (grpc.StatusCode.INTERNAL, "internal error")


def test_an_invalid_argument_names_its_first_violations_in_a_bounded_message() -> None:
    few = InvalidArgument([FieldViolation(f"messages[{i}].role", "unknown") for i in range(300)])
    assert len(few.violations) == MAX_VIOLATIONS and few.message.endswith("(and 290 more)")
    long = InvalidArgument([FieldViolation(f"messages[{i}].content", "x" * 200) for i in range(9)])
    assert len(long.message) == MAX_MESSAGE
    code, message, _ = aborted_with(long, False)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and message == long.message
