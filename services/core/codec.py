"""Translation between stored events and the public protobuf `RunEvent`, and of the
tenants' shares of a worker (`TenantShare`).

The one place the event payloads (JSON objects named like the proto fields)
meet the generated protobuf types.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from services.core.runs import RunState, StoredEvent
from services.core.shares import TenantLoad
from tollgate.v1 import events_pb2, worker_pb2

PROTO_STATES: Mapping[RunState, int] = {
    RunState.QUEUED: events_pb2.RUN_STATE_QUEUED,
    RunState.PREFILL: events_pb2.RUN_STATE_PREFILL,
    RunState.STREAMING: events_pb2.RUN_STATE_STREAMING,
    RunState.COMPLETED: events_pb2.RUN_STATE_COMPLETED,
    RunState.FAILED: events_pb2.RUN_STATE_FAILED,
    RunState.CANCELLED: events_pb2.RUN_STATE_CANCELLED,
    RunState.BILLED: events_pb2.RUN_STATE_BILLED,
}
STATES_BY_PROTO: Mapping[int, RunState] = {v: k for k, v in PROTO_STATES.items()}
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def rfc3339(moment: datetime) -> str:
    """A timestamp as protobuf's JSON mapping and CloudEvents write it, in UTC."""
    return moment.astimezone(UTC).isoformat().replace("+00:00", "Z")


def to_proto(event: StoredEvent) -> events_pb2.RunEvent:
    message = events_pb2.RunEvent(
        run_id=event.run_id,
        seq=event.seq,
        state=PROTO_STATES[event.kind],  # type: ignore[arg-type]
        tenant_id=event.tenant_id,
        live=event.live,
    )
    message.time.FromDatetime(event.created_at)
    _fill_body(message, event.kind, event.payload)
    return message


def encoded_size(kind: RunState, payload: Mapping[str, Any]) -> int:
    """Bytes of the `kind` body holding `payload`, as `to_proto` encodes it: all of an
    event but the few bytes of its envelope (ids, seq, time)."""
    message = events_pb2.RunEvent()
    _fill_body(message, kind, payload)
    return message.ByteSize()


def _fill_body(message: events_pb2.RunEvent, kind: RunState, payload: Mapping[str, Any]) -> None:
    body = getattr(message, str(kind))
    body.SetInParent()  # an empty payload still names the event's kind
    rest = _fill_plain_fields(body, payload)
    if rest:
        json_format.ParseDict(rest, body)


# Field type -> the Python type a payload value must have exactly to be assigned as it is.
_PLAIN_TYPES: Mapping[int, type] = {
    FieldDescriptor.TYPE_INT32: int,
    FieldDescriptor.TYPE_INT64: int,
    FieldDescriptor.TYPE_UINT32: int,
    FieldDescriptor.TYPE_UINT64: int,
    FieldDescriptor.TYPE_SINT32: int,
    FieldDescriptor.TYPE_SINT64: int,
    FieldDescriptor.TYPE_STRING: str,
    FieldDescriptor.TYPE_BOOL: bool,
}


def _fill_plain_fields(body: Message, payload: Mapping[str, Any]) -> dict[str, Any]:
    """Sets the fields of `body` whose values need no conversion (token id lists, text,
    counts); returns the rest of `payload`, for the JSON mapping to convert.

    ParseDict checks and converts values one by one in Python: for a prompt of a few
    hundred tokens that is most of the conversion's time, and for a `streaming` event
    all of it. Assignment refuses what the mapping would (an integer out of range), with
    ValueError where the mapping raises its ParseError.
    """
    rest = {}
    fields = body.DESCRIPTOR.fields_by_name
    for name, value in payload.items():
        field = fields.get(name)
        plain = _PLAIN_TYPES.get(field.type) if field is not None else None
        if plain is None or field is None:
            rest[name] = value
        elif not field.is_repeated and type(value) is plain:
            setattr(body, name, value)
        elif field.is_repeated and isinstance(value, list) and all(type(v) is plain for v in value):
            getattr(body, name).extend(value)
        else:
            rest[name] = value
    return rest


def from_proto(message: events_pb2.RunEvent, traceparent: str = "") -> StoredEvent:
    """The stored event that `to_proto` made `message` from, but for fields at their default,
    which the message does not carry; `traceparent` travels beside it (a Kafka header)."""
    return StoredEvent(
        run_id=message.run_id,
        seq=message.seq,
        kind=kind_of(message),
        tenant_id=message.tenant_id,
        payload=payload_of(message),
        # As Timestamp.ToDatetime, which takes twice as long.
        created_at=_EPOCH
        + timedelta(seconds=message.time.seconds, microseconds=message.time.nanos // 1000),
        traceparent=traceparent,
    )


def payload_of(message: events_pb2.RunEvent) -> dict[str, Any]:
    """The payload dict of a protobuf event: the inverse of `to_proto`'s body.

    Values are as the services store them: integers as `int` (the JSON mapping gives the
    64-bit ones as strings), enums by name, messages as dicts. Read field by field, as
    `_fill_plain_fields` writes them: the JSON mapping would be most of a consumer's time.
    """
    kind = message.WhichOneof("kind")
    if kind is None:
        return {}
    return _payload_dict(getattr(message, kind))


def _payload_dict(message: Message) -> dict[str, Any]:
    return {field.name: _payload_value(field, value) for field, value in message.ListFields()}


def _payload_value(field: FieldDescriptor, value: Any) -> Any:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        if field.message_type.file.package == "google.protobuf":  # Timestamp, Duration
            convert: Any = json_format.MessageToDict
        else:
            convert = _payload_dict
        return [convert(v) for v in value] if field.is_repeated else convert(value)
    if field.type == FieldDescriptor.TYPE_ENUM:
        names = field.enum_type.values_by_number
        return [names[v].name for v in value] if field.is_repeated else names[value].name
    return value[:] if field.is_repeated else value  # a slice copies faster than list()


def kind_of(message: events_pb2.RunEvent) -> RunState:
    return STATES_BY_PROTO[message.state]


def tenant_shares(loads: Iterable[TenantLoad]) -> list[worker_pb2.TenantShare]:
    """Each tenant's runs on a worker (`services/core/shares.py`) as `TenantShare`s."""
    return [
        worker_pb2.TenantShare(
            tenant_id=load.tenant_id,
            weight=load.weight,
            num_kv_blocks=load.num_kv_blocks,
            num_runs=load.num_runs,
            num_suspended_runs=load.num_suspended_runs,
            num_suspendable_kv_blocks=load.num_suspendable_blocks,
        )
        for load in loads
    ]


def tenant_loads_of(shares: Iterable[worker_pb2.TenantShare]) -> tuple[TenantLoad, ...]:
    return tuple(
        TenantLoad(
            s.tenant_id,
            max(1, s.weight),
            s.num_kv_blocks,
            s.num_runs,
            s.num_suspended_runs,
            s.num_suspendable_kv_blocks,
        )
        for s in shares
    )
