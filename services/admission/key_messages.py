"""Translation between the admin API's key messages and admission's key dataclasses."""

from __future__ import annotations

from datetime import UTC, datetime

from google.protobuf import timestamp_pb2

from services.admission.keys import (
    DEFAULT_OVERLAP_SECONDS,
    KeyRecord,
    KeyScopes,
    overlap_violation,
    scope_violations,
)
from services.core.errors import FieldViolation, InvalidArgument
from services.core.validation import duration_seconds, timestamp_violation
from tollgate.v1 import admin_pb2


def scopes_from_proto(request: admin_pb2.CreateApiKeyRequest) -> KeyScopes:
    """The scopes a CreateApiKey asks for; raises InvalidArgument naming each bad field."""
    expire_time = None
    if request.HasField("expire_time"):
        stamp = request.expire_time
        bad_time = timestamp_violation("expire_time", stamp.seconds, stamp.nanos)
        if bad_time is not None:
            raise InvalidArgument([bad_time])
        expire_time = stamp.ToDatetime(tzinfo=UTC)
    scopes = KeyScopes(tuple(request.allowed_models), expire_time, request.alias.strip())
    violations = scope_violations(scopes, datetime.now(UTC))
    if violations:
        raise InvalidArgument(violations)
    return scopes


def overlap_from_proto(request: admin_pb2.RotateApiKeyRequest) -> float:
    """Seconds the replaced secret keeps working; raises InvalidArgument past the bounds."""
    if not request.HasField("overlap"):
        return DEFAULT_OVERLAP_SECONDS
    seconds = duration_seconds(request.overlap.seconds, request.overlap.nanos)
    if seconds is None:
        raise InvalidArgument([FieldViolation("overlap", "is not a valid duration")])
    bad = overlap_violation(seconds)
    if bad is not None:
        raise InvalidArgument([bad])
    return seconds


def key_to_proto(key: KeyRecord) -> admin_pb2.ApiKey:
    message = admin_pb2.ApiKey(
        key_id=key.key_id,
        tenant_id=key.tenant_id,
        secret=key.secret,
        revoked=key.revoked,
        allowed_models=key.scopes.allowed_models,
        alias=key.scopes.alias,
    )
    _set_time(message.expire_time, key.scopes.expire_time)
    _set_time(message.last_used_time, key.last_used_time)
    _set_time(message.create_time, key.create_time)
    _set_time(message.previous_secret_expire_time, key.previous_secret_expire_time)
    return message


def _set_time(field: timestamp_pb2.Timestamp, moment: datetime | None) -> None:
    if moment is not None:
        field.FromDatetime(moment)
