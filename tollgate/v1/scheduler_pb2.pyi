import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from tollgate.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetQueueStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class QueueStats(_message.Message):
    __slots__ = ("num_interactive", "num_batch", "num_running", "num_workers", "num_free_blocks", "max_run_tokens", "num_total_blocks", "num_queued_interactive_blocks", "num_queued_batch_blocks", "workers")
    class MaxRunTokensEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NUM_INTERACTIVE_FIELD_NUMBER: _ClassVar[int]
    NUM_BATCH_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_RUN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUED_INTERACTIVE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUED_BATCH_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    num_interactive: int
    num_batch: int
    num_running: int
    num_workers: int
    num_free_blocks: int
    max_run_tokens: _containers.ScalarMap[str, int]
    num_total_blocks: int
    num_queued_interactive_blocks: int
    num_queued_batch_blocks: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerLoad]
    def __init__(self, num_interactive: _Optional[int] = ..., num_batch: _Optional[int] = ..., num_running: _Optional[int] = ..., num_workers: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., max_run_tokens: _Optional[_Mapping[str, int]] = ..., num_total_blocks: _Optional[int] = ..., num_queued_interactive_blocks: _Optional[int] = ..., num_queued_batch_blocks: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerLoad, _Mapping]]] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("worker_id", "model", "num_free_blocks", "num_total_blocks", "num_running", "alive", "draining", "suspect", "engine_kind", "tenants", "suspends_runs")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    SUSPECT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_KIND_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    SUSPENDS_RUNS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    model: str
    num_free_blocks: int
    num_total_blocks: int
    num_running: int
    alive: bool
    draining: bool
    suspect: bool
    engine_kind: str
    tenants: _containers.RepeatedCompositeFieldContainer[_worker_pb2.TenantShare]
    suspends_runs: bool
    def __init__(self, worker_id: _Optional[str] = ..., model: _Optional[str] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., num_running: _Optional[int] = ..., alive: _Optional[bool] = ..., draining: _Optional[bool] = ..., suspect: _Optional[bool] = ..., engine_kind: _Optional[str] = ..., tenants: _Optional[_Iterable[_Union[_worker_pb2.TenantShare, _Mapping]]] = ..., suspends_runs: _Optional[bool] = ...) -> None: ...

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "address", "model", "boot_id", "adapters", "engine_kind")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_KIND_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    model: str
    boot_id: str
    adapters: _containers.RepeatedScalarFieldContainer[str]
    engine_kind: str
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., model: _Optional[str] = ..., boot_id: _Optional[str] = ..., adapters: _Optional[_Iterable[str]] = ..., engine_kind: _Optional[str] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ("heartbeat_interval_seconds",)
    HEARTBEAT_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_seconds: float
    def __init__(self, heartbeat_interval_seconds: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "num_free_blocks", "running_run_ids", "draining", "boot_id", "tenants", "suspends_runs")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_RUN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    SUSPENDS_RUNS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    num_free_blocks: int
    running_run_ids: _containers.RepeatedScalarFieldContainer[str]
    draining: bool
    boot_id: str
    tenants: _containers.RepeatedCompositeFieldContainer[_worker_pb2.TenantShare]
    suspends_runs: bool
    def __init__(self, worker_id: _Optional[str] = ..., num_free_blocks: _Optional[int] = ..., running_run_ids: _Optional[_Iterable[str]] = ..., draining: _Optional[bool] = ..., boot_id: _Optional[str] = ..., tenants: _Optional[_Iterable[_Union[_worker_pb2.TenantShare, _Mapping]]] = ..., suspends_runs: _Optional[bool] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class SchedulerCancelRunRequest(_message.Message):
    __slots__ = ("run_id", "reason")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    reason: str
    def __init__(self, run_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class SchedulerCancelRunResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class RunsQueuedRequest(_message.Message):
    __slots__ = ("run_ids", "runs")
    RUN_IDS_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    run_ids: _containers.RepeatedScalarFieldContainer[str]
    runs: _containers.RepeatedCompositeFieldContainer[HintedRun]
    def __init__(self, run_ids: _Optional[_Iterable[str]] = ..., runs: _Optional[_Iterable[_Union[HintedRun, _Mapping]]] = ...) -> None: ...

class HintedRun(_message.Message):
    __slots__ = ("run_id", "tenant_id", "model", "priority", "last_seq", "queued_payload_json", "traceparent", "queued_at", "tenant_weight")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PAYLOAD_JSON_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    QUEUED_AT_FIELD_NUMBER: _ClassVar[int]
    TENANT_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    tenant_id: str
    model: str
    priority: str
    last_seq: int
    queued_payload_json: str
    traceparent: str
    queued_at: _timestamp_pb2.Timestamp
    tenant_weight: int
    def __init__(self, run_id: _Optional[str] = ..., tenant_id: _Optional[str] = ..., model: _Optional[str] = ..., priority: _Optional[str] = ..., last_seq: _Optional[int] = ..., queued_payload_json: _Optional[str] = ..., traceparent: _Optional[str] = ..., queued_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., tenant_weight: _Optional[int] = ...) -> None: ...

class RunsQueuedResponse(_message.Message):
    __slots__ = ("num_taken",)
    NUM_TAKEN_FIELD_NUMBER: _ClassVar[int]
    num_taken: int
    def __init__(self, num_taken: _Optional[int] = ...) -> None: ...
