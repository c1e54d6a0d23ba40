"""The scheduler's TOLLGATE_* settings."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from services.core.config import CommonSettings, env_float, env_int, env_map


@dataclass(frozen=True, slots=True)
class SchedulerSettings:
    common: CommonSettings
    # worker_id -> host:port of workers known from configuration
    workers: Mapping[str, str] = field(default_factory=dict)
    rescan_seconds: float = 2.0
    worker_timeout: float = 5.0
    heartbeat_interval: float = 1.0
    max_skip_age: float = 30.0
    block_size: int = 16
    kafka_session_timeout_ms: int = 10_000

    @classmethod
    def from_env(cls) -> SchedulerSettings:
        return cls(
            common=CommonSettings.from_env(),
            workers=env_map("TOLLGATE_WORKERS"),
            rescan_seconds=env_float("TOLLGATE_SCHEDULER_RESCAN", 2.0),
            worker_timeout=env_float("TOLLGATE_WORKER_TIMEOUT", 5.0),
            heartbeat_interval=env_float("TOLLGATE_HEARTBEAT_INTERVAL", 1.0),
            max_skip_age=env_float("TOLLGATE_SCHEDULER_MAX_SKIP_SECONDS", 30.0),
            block_size=env_int("TOLLGATE_BLOCK_SIZE", 16),
            kafka_session_timeout_ms=env_int("TOLLGATE_KAFKA_SESSION_TIMEOUT_MS", 10_000),
        )
