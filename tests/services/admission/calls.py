"""Calls on a running admission, and what tests read from their answers."""

from typing import Any

import grpc
import sqlalchemy as sa
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from services.core.auth import split_key
from tests.services.admission.running import MODEL, Admission, auth
from tollgate.v1 import events_pb2, gateway_pb2


def request(**overrides: object) -> events_pb2.GenerateRequest:
    sampling = events_pb2.SamplingParams(max_tokens=8)
    message = events_pb2.GenerateRequest(model=MODEL, prompt="hello toll gate", sampling=sampling)
    for name, value in overrides.items():
        if name.startswith("sampling_"):
            setattr(message.sampling, name.removeprefix("sampling_"), value)
        elif isinstance(value, duration_pb2.Duration):
            getattr(message, name).CopyFrom(value)
        else:
            setattr(message, name, value)
    return message


async def count_runs(admission: Admission) -> int:
    async with admission.db.connect() as conn:
        return int(await conn.scalar(sa.text("SELECT count(*) FROM runs")) or 0)


def violations(error: grpc.aio.AioRpcError) -> list[str]:
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None
    fields = []
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            fields += [v.field for v in bad.field_violations]
    return fields


async def first_event(
    admission: Admission, key: str, req: events_pb2.GenerateRequest | gateway_pb2.StreamRunRequest
) -> events_pb2.RunEvent:
    """The first event of a Generate or StreamRun call, which it then cancels."""
    if isinstance(req, gateway_pb2.StreamRunRequest):
        call = admission.gateway.StreamRun(req, metadata=auth(key))
    else:
        call = admission.gateway.Generate(req, metadata=auth(key))
    event = await call.read()
    call.cancel()
    return event


def details(error: grpc.aio.AioRpcError) -> dict[str, Any]:
    """The QuotaFailure, RetryInfo and ErrorInfo of a refusal, by message name."""
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None
    found: dict[str, Any] = {}
    for kind in (
        error_details_pb2.QuotaFailure,
        error_details_pb2.RetryInfo,
        error_details_pb2.ErrorInfo,
    ):
        for packed in status.details:
            if packed.Is(kind.DESCRIPTOR):
                found[kind.DESCRIPTOR.name] = message = kind()
                packed.Unpack(message)
    return found


def secret_part(key: str) -> str:
    """The secret of a whole API key (`tg_<key_id>_<secret>`; the secret may hold `_`)."""
    parts = split_key(key)
    assert parts is not None, "not an API key"
    return parts[1]
