from tollgate.v1 import events_pb2 as _events_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AssignRunRequest(_message.Message):
    __slots__ = ("run_id", "tenant_id", "model", "prompt_token_ids", "sampling", "priority", "lease_epoch", "traceparent", "last_seq", "cache_namespace", "tenant_weight")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    LEASE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    CACHE_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TENANT_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    tenant_id: str
    model: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _events_pb2.SamplingParams
    priority: _events_pb2.Priority
    lease_epoch: int
    traceparent: str
    last_seq: int
    cache_namespace: str
    tenant_weight: int
    def __init__(self, run_id: _Optional[str] = ..., tenant_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_events_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[_Union[_events_pb2.Priority, str]] = ..., lease_epoch: _Optional[int] = ..., traceparent: _Optional[str] = ..., last_seq: _Optional[int] = ..., cache_namespace: _Optional[str] = ..., tenant_weight: _Optional[int] = ...) -> None: ...

class AssignRunResponse(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class CancelAssignedRunRequest(_message.Message):
    __slots__ = ("run_id", "reason")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    reason: str
    def __init__(self, run_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CancelAssignedRunResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetWorkerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "model", "num_free_blocks", "num_total_blocks", "block_size", "running_run_ids", "draining", "boot_id", "adapters", "engine_kind", "max_run_tokens", "tenants", "suspends_runs")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_RUN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_KIND_FIELD_NUMBER: _ClassVar[int]
    MAX_RUN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    SUSPENDS_RUNS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    model: str
    num_free_blocks: int
    num_total_blocks: int
    block_size: int
    running_run_ids: _containers.RepeatedScalarFieldContainer[str]
    draining: bool
    boot_id: str
    adapters: _containers.RepeatedScalarFieldContainer[str]
    engine_kind: str
    max_run_tokens: int
    tenants: _containers.RepeatedCompositeFieldContainer[TenantShare]
    suspends_runs: bool
    def __init__(self, worker_id: _Optional[str] = ..., model: _Optional[str] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., running_run_ids: _Optional[_Iterable[str]] = ..., draining: _Optional[bool] = ..., boot_id: _Optional[str] = ..., adapters: _Optional[_Iterable[str]] = ..., engine_kind: _Optional[str] = ..., max_run_tokens: _Optional[int] = ..., tenants: _Optional[_Iterable[_Union[TenantShare, _Mapping]]] = ..., suspends_runs: _Optional[bool] = ...) -> None: ...

class TenantShare(_message.Message):
    __slots__ = ("tenant_id", "weight", "num_kv_blocks", "num_runs", "num_suspended_runs", "num_suspendable_kv_blocks")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNS_FIELD_NUMBER: _ClassVar[int]
    NUM_SUSPENDED_RUNS_FIELD_NUMBER: _ClassVar[int]
    NUM_SUSPENDABLE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    weight: int
    num_kv_blocks: int
    num_runs: int
    num_suspended_runs: int
    num_suspendable_kv_blocks: int
    def __init__(self, tenant_id: _Optional[str] = ..., weight: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., num_runs: _Optional[int] = ..., num_suspended_runs: _Optional[int] = ..., num_suspendable_kv_blocks: _Optional[int] = ...) -> None: ...
