from __future__ import annotations

import os
import socket

import pytest
import torch

from services.core.config import ConfigError
from services.worker.app import WorkerSettings, advertised_address


@pytest.fixture
def worker_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setenv("TOLLGATE_DATABASE_URL", "postgresql+psycopg://localhost/x")
    monkeypatch.setenv("TOLLGATE_KAFKA_BOOTSTRAP", "127.0.0.1:9092")
    monkeypatch.setenv("TOLLGATE_MODELS", "tiny=/models/tiny")
    for name in (
        "TOLLGATE_QUANTIZATION",
        "TOLLGATE_KV_DTYPE",
        "TOLLGATE_ENGINE_THREADS",
        "TOLLGATE_RESERVED_CORES",
        "TOLLGATE_ENGINE_NICE",
        "TOLLGATE_ENGINE_KIND",
        "TOLLGATE_ENGINE_URL",
        "TOLLGATE_ENGINE_MAX_RUNS",
    ):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_engine_defaults_to_full_precision(worker_env: pytest.MonkeyPatch) -> None:
    engine = WorkerSettings.from_env().engine
    assert (engine.quantization, engine.kv_dtype, engine.num_threads) == (None, "auto", None)


def test_quantization_and_kv_dtype_come_from_the_environment(
    worker_env: pytest.MonkeyPatch,
) -> None:
    worker_env.setenv("TOLLGATE_QUANTIZATION", "int8")
    worker_env.setenv("TOLLGATE_KV_DTYPE", "bfloat16")
    worker_env.setenv("TOLLGATE_ENGINE_THREADS", "1")
    engine = WorkerSettings.from_env().engine
    assert (engine.quantization, engine.kv_dtype, engine.num_threads) == ("int8", "bfloat16", 1)


def test_reserved_cores_come_off_torchs_thread_count_unless_threads_are_set(
    worker_env: pytest.MonkeyPatch,
) -> None:
    worker_env.setattr(torch, "get_num_threads", lambda: 8)
    worker_env.setenv("TOLLGATE_RESERVED_CORES", "1")
    assert WorkerSettings.from_env().engine.num_threads == 7
    worker_env.setenv("TOLLGATE_RESERVED_CORES", "12")
    assert WorkerSettings.from_env().engine.num_threads == 1
    worker_env.setenv("TOLLGATE_ENGINE_THREADS", "3")
    assert WorkerSettings.from_env().engine.num_threads == 3


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("TOLLGATE_QUANTIZATION", "int4"),
        ("TOLLGATE_KV_DTYPE", "float16"),
        ("TOLLGATE_ENGINE_THREADS", "-1"),
        ("TOLLGATE_RESERVED_CORES", "-1"),
    ],
)
def test_an_unknown_value_names_the_variable(
    worker_env: pytest.MonkeyPatch, name: str, value: str
) -> None:
    worker_env.setenv(name, value)
    with pytest.raises(ConfigError, match=name):
        WorkerSettings.from_env()


def test_the_engine_process_runs_at_the_services_niceness_unless_told_otherwise(
    worker_env: pytest.MonkeyPatch,
) -> None:
    assert WorkerSettings.from_env().engine_niceness == 0
    worker_env.setenv("TOLLGATE_ENGINE_NICE", "5")
    assert WorkerSettings.from_env().engine_niceness == 5


@pytest.mark.parametrize("value", ["-1", "20"])
def test_a_niceness_out_of_range_is_refused(worker_env: pytest.MonkeyPatch, value: str) -> None:
    worker_env.setenv("TOLLGATE_ENGINE_NICE", value)
    with pytest.raises(ConfigError, match="TOLLGATE_ENGINE_NICE"):
        WorkerSettings.from_env()


def test_each_worker_process_names_itself_uniquely(worker_env: pytest.MonkeyPatch) -> None:
    worker_env.delenv("TOLLGATE_WORKER_ID", raising=False)
    first, second = (WorkerSettings.from_env().worker_id for _ in range(2))
    assert first != second
    assert first.startswith(f"{socket.gethostname()}-{os.getpid()}-")
    worker_env.setenv("TOLLGATE_WORKER_ID", "gpu-7")
    assert WorkerSettings.from_env().worker_id == "gpu-7"


def test_a_worker_on_a_wildcard_address_advertises_its_hosts_own() -> None:
    assert advertised_address("127.0.0.1:5000") == "127.0.0.1:5000"
    own = socket.gethostbyname(socket.gethostname())
    assert advertised_address("0.0.0.0:5000") == f"{own}:5000"


def test_the_engine_is_built_in_unless_an_engine_server_or_the_simulation_is_named(
    worker_env: pytest.MonkeyPatch,
) -> None:
    assert WorkerSettings.from_env().backend.kind == "builtin"
    worker_env.setenv("TOLLGATE_ENGINE_KIND", "vllm")
    worker_env.setenv("TOLLGATE_ENGINE_URL", "http://vllm:8000")
    backend = WorkerSettings.from_env().backend
    assert backend.is_remote and backend.url == "http://vllm:8000" and backend.max_running == 16
    worker_env.setenv("TOLLGATE_ENGINE_KIND", "sim")
    worker_env.delenv("TOLLGATE_ENGINE_URL")
    assert WorkerSettings.from_env().backend.max_running == 256


@pytest.mark.parametrize(
    ("variables", "named"),
    [
        ({"TOLLGATE_ENGINE_KIND": "tgi"}, "TOLLGATE_ENGINE_KIND"),
        ({"TOLLGATE_ENGINE_KIND": "vllm"}, "TOLLGATE_ENGINE_URL"),
        ({"TOLLGATE_ENGINE_URL": "http://vllm:8000"}, "TOLLGATE_ENGINE_KIND"),
        ({"TOLLGATE_ENGINE_KIND": "sim", "TOLLGATE_ENGINE_MAX_RUNS": "0"}, "MAX_RUNS"),
        ({"TOLLGATE_ENGINE_KIND": "sim", "TOLLGATE_ENGINE_CACHE_PROMPT": "yes"}, "CACHE_PROMPT"),
    ],
)
def test_a_bad_engine_setting_names_its_variable(
    worker_env: pytest.MonkeyPatch, variables: dict[str, str], named: str
) -> None:
    for name, value in variables.items():
        worker_env.setenv(name, value)
    with pytest.raises(ConfigError, match=named):
        WorkerSettings.from_env()
