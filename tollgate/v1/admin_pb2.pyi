import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tenant(_message.Message):
    __slots__ = ("tenant_id", "name", "weight", "quota", "key_quotas")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    QUOTA_FIELD_NUMBER: _ClassVar[int]
    KEY_QUOTAS_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    name: str
    weight: int
    quota: Quota
    key_quotas: _containers.RepeatedCompositeFieldContainer[Quota]
    def __init__(self, tenant_id: _Optional[str] = ..., name: _Optional[str] = ..., weight: _Optional[int] = ..., quota: _Optional[_Union[Quota, _Mapping]] = ..., key_quotas: _Optional[_Iterable[_Union[Quota, _Mapping]]] = ...) -> None: ...

class Quota(_message.Message):
    __slots__ = ("tenant_id", "max_kv_blocks", "max_concurrent_runs", "max_concurrent_streams", "requests_per_minute", "input_tokens_per_minute", "output_tokens_per_minute", "budget_micros", "budget_period", "key_id")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_RUNS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_STREAMS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_PER_MINUTE_FIELD_NUMBER: _ClassVar[int]
    INPUT_TOKENS_PER_MINUTE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_PER_MINUTE_FIELD_NUMBER: _ClassVar[int]
    BUDGET_MICROS_FIELD_NUMBER: _ClassVar[int]
    BUDGET_PERIOD_FIELD_NUMBER: _ClassVar[int]
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    max_kv_blocks: int
    max_concurrent_runs: int
    max_concurrent_streams: int
    requests_per_minute: int
    input_tokens_per_minute: int
    output_tokens_per_minute: int
    budget_micros: int
    budget_period: str
    key_id: str
    def __init__(self, tenant_id: _Optional[str] = ..., max_kv_blocks: _Optional[int] = ..., max_concurrent_runs: _Optional[int] = ..., max_concurrent_streams: _Optional[int] = ..., requests_per_minute: _Optional[int] = ..., input_tokens_per_minute: _Optional[int] = ..., output_tokens_per_minute: _Optional[int] = ..., budget_micros: _Optional[int] = ..., budget_period: _Optional[str] = ..., key_id: _Optional[str] = ...) -> None: ...

class CreateTenantRequest(_message.Message):
    __slots__ = ("name", "weight")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    name: str
    weight: int
    def __init__(self, name: _Optional[str] = ..., weight: _Optional[int] = ...) -> None: ...

class GetTenantRequest(_message.Message):
    __slots__ = ("tenant_id",)
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    def __init__(self, tenant_id: _Optional[str] = ...) -> None: ...

class ListTenantsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTenantsResponse(_message.Message):
    __slots__ = ("tenants",)
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    tenants: _containers.RepeatedCompositeFieldContainer[Tenant]
    def __init__(self, tenants: _Optional[_Iterable[_Union[Tenant, _Mapping]]] = ...) -> None: ...

class ApiKey(_message.Message):
    __slots__ = ("key_id", "tenant_id", "secret", "revoked", "allowed_models", "expire_time", "alias", "last_used_time", "create_time", "previous_secret_expire_time")
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    REVOKED_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_MODELS_FIELD_NUMBER: _ClassVar[int]
    EXPIRE_TIME_FIELD_NUMBER: _ClassVar[int]
    ALIAS_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_TIME_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_SECRET_EXPIRE_TIME_FIELD_NUMBER: _ClassVar[int]
    key_id: str
    tenant_id: str
    secret: str
    revoked: bool
    allowed_models: _containers.RepeatedScalarFieldContainer[str]
    expire_time: _timestamp_pb2.Timestamp
    alias: str
    last_used_time: _timestamp_pb2.Timestamp
    create_time: _timestamp_pb2.Timestamp
    previous_secret_expire_time: _timestamp_pb2.Timestamp
    def __init__(self, key_id: _Optional[str] = ..., tenant_id: _Optional[str] = ..., secret: _Optional[str] = ..., revoked: _Optional[bool] = ..., allowed_models: _Optional[_Iterable[str]] = ..., expire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., alias: _Optional[str] = ..., last_used_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., previous_secret_expire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class CreateApiKeyRequest(_message.Message):
    __slots__ = ("tenant_id", "allowed_models", "expire_time", "alias")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_MODELS_FIELD_NUMBER: _ClassVar[int]
    EXPIRE_TIME_FIELD_NUMBER: _ClassVar[int]
    ALIAS_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    allowed_models: _containers.RepeatedScalarFieldContainer[str]
    expire_time: _timestamp_pb2.Timestamp
    alias: str
    def __init__(self, tenant_id: _Optional[str] = ..., allowed_models: _Optional[_Iterable[str]] = ..., expire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., alias: _Optional[str] = ...) -> None: ...

class ListApiKeysRequest(_message.Message):
    __slots__ = ("tenant_id", "page_size", "page_token")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    page_size: int
    page_token: str
    def __init__(self, tenant_id: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListApiKeysResponse(_message.Message):
    __slots__ = ("api_keys", "next_page_token")
    API_KEYS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    api_keys: _containers.RepeatedCompositeFieldContainer[ApiKey]
    next_page_token: str
    def __init__(self, api_keys: _Optional[_Iterable[_Union[ApiKey, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class RotateApiKeyRequest(_message.Message):
    __slots__ = ("key_id", "overlap")
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_FIELD_NUMBER: _ClassVar[int]
    key_id: str
    overlap: _duration_pb2.Duration
    def __init__(self, key_id: _Optional[str] = ..., overlap: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class RevokeApiKeyRequest(_message.Message):
    __slots__ = ("key_id",)
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    key_id: str
    def __init__(self, key_id: _Optional[str] = ...) -> None: ...

class SetQuotaRequest(_message.Message):
    __slots__ = ("quota",)
    QUOTA_FIELD_NUMBER: _ClassVar[int]
    quota: Quota
    def __init__(self, quota: _Optional[_Union[Quota, _Mapping]] = ...) -> None: ...
