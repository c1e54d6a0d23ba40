"""What the contract tests of the fakes share: reading a refusal the way a client does."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2

from tollgate.errors import unpack_details


async def refusal(call: Awaitable[Any]) -> tuple[grpc.StatusCode, list[str]]:
    """The status code of a call that fails, and the fields its BadRequest names."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    fields = [
        violation.field
        for detail in unpack_details(caught.value)
        if isinstance(detail, error_details_pb2.BadRequest)
        for violation in detail.field_violations
    ]
    return caught.value.code(), fields
