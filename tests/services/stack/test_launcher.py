from pathlib import Path

import pytest

from services.stack.launcher import (
    ENGINE_THREADS,
    Services,
    StackConfig,
    available_cpus,
    colocated_engine_threads,
)


def _services(**extra_env: str) -> Services:
    config = StackConfig(
        database_url="postgresql://db/x",
        kafka_bootstrap="127.0.0.1:9092",
        model_name="tiny",
        model_dir=Path("/models/tiny"),
        admin_token="t",
        extra_env=extra_env,
    )
    return Services(config, Path("/tmp/logs"))


def test_the_engine_leaves_one_core_to_the_other_services() -> None:
    assert [colocated_engine_threads(n) for n in (1, 2, 4, 16)] == [1, 1, 3, 15]


def test_the_worker_gets_the_colocated_thread_count_unless_one_is_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(ENGINE_THREADS, raising=False)
    expected = str(colocated_engine_threads(available_cpus()))
    assert _services().worker_env()[ENGINE_THREADS] == expected
    # Set by the caller, in the stack's extra variables or the environment: left alone.
    assert ENGINE_THREADS not in _services(**{ENGINE_THREADS: "2"}).worker_env()
    monkeypatch.setenv(ENGINE_THREADS, "2")
    assert ENGINE_THREADS not in _services().worker_env()
