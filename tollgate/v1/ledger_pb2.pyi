import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from tollgate.v1 import events_pb2 as _events_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ListLedgerEntriesRequest(_message.Message):
    __slots__ = ("tenant_id", "run_id", "page_size", "page_token")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    run_id: str
    page_size: int
    page_token: str
    def __init__(self, tenant_id: _Optional[str] = ..., run_id: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListLedgerEntriesResponse(_message.Message):
    __slots__ = ("entries", "next_page_token")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[_events_pb2.LedgerEntry]
    next_page_token: str
    def __init__(self, entries: _Optional[_Iterable[_Union[_events_pb2.LedgerEntry, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class GetUsageRequest(_message.Message):
    __slots__ = ("tenant_id", "start_time", "end_time")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    START_TIME_FIELD_NUMBER: _ClassVar[int]
    END_TIME_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    start_time: _timestamp_pb2.Timestamp
    end_time: _timestamp_pb2.Timestamp
    def __init__(self, tenant_id: _Optional[str] = ..., start_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., end_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class UsageLine(_message.Message):
    __slots__ = ("billing_type", "quantity", "amount_micros")
    BILLING_TYPE_FIELD_NUMBER: _ClassVar[int]
    QUANTITY_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_MICROS_FIELD_NUMBER: _ClassVar[int]
    billing_type: str
    quantity: int
    amount_micros: int
    def __init__(self, billing_type: _Optional[str] = ..., quantity: _Optional[int] = ..., amount_micros: _Optional[int] = ...) -> None: ...

class GetUsageResponse(_message.Message):
    __slots__ = ("tenant_id", "num_runs", "lines", "amount_micros", "currency", "limits")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNS_FIELD_NUMBER: _ClassVar[int]
    LINES_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_MICROS_FIELD_NUMBER: _ClassVar[int]
    CURRENCY_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    num_runs: int
    lines: _containers.RepeatedCompositeFieldContainer[UsageLine]
    amount_micros: int
    currency: str
    limits: _containers.RepeatedCompositeFieldContainer[LimitUsage]
    def __init__(self, tenant_id: _Optional[str] = ..., num_runs: _Optional[int] = ..., lines: _Optional[_Iterable[_Union[UsageLine, _Mapping]]] = ..., amount_micros: _Optional[int] = ..., currency: _Optional[str] = ..., limits: _Optional[_Iterable[_Union[LimitUsage, _Mapping]]] = ...) -> None: ...

class LimitUsage(_message.Message):
    __slots__ = ("subject", "name", "limit", "used", "remaining", "reset_time", "budget_period")
    SUBJECT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    USED_FIELD_NUMBER: _ClassVar[int]
    REMAINING_FIELD_NUMBER: _ClassVar[int]
    RESET_TIME_FIELD_NUMBER: _ClassVar[int]
    BUDGET_PERIOD_FIELD_NUMBER: _ClassVar[int]
    subject: str
    name: str
    limit: int
    used: int
    remaining: int
    reset_time: _timestamp_pb2.Timestamp
    budget_period: str
    def __init__(self, subject: _Optional[str] = ..., name: _Optional[str] = ..., limit: _Optional[int] = ..., used: _Optional[int] = ..., remaining: _Optional[int] = ..., reset_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., budget_period: _Optional[str] = ...) -> None: ...

class GetReconciliationRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Reconciliation(_message.Message):
    __slots__ = ("ok", "unbilled_run_ids", "unreleased_run_ids", "mismatched_run_ids", "stuck_run_ids")
    OK_FIELD_NUMBER: _ClassVar[int]
    UNBILLED_RUN_IDS_FIELD_NUMBER: _ClassVar[int]
    UNRELEASED_RUN_IDS_FIELD_NUMBER: _ClassVar[int]
    MISMATCHED_RUN_IDS_FIELD_NUMBER: _ClassVar[int]
    STUCK_RUN_IDS_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    unbilled_run_ids: _containers.RepeatedScalarFieldContainer[str]
    unreleased_run_ids: _containers.RepeatedScalarFieldContainer[str]
    mismatched_run_ids: _containers.RepeatedScalarFieldContainer[str]
    stuck_run_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, ok: _Optional[bool] = ..., unbilled_run_ids: _Optional[_Iterable[str]] = ..., unreleased_run_ids: _Optional[_Iterable[str]] = ..., mismatched_run_ids: _Optional[_Iterable[str]] = ..., stuck_run_ids: _Optional[_Iterable[str]] = ...) -> None: ...
