from pathlib import Path

import pytest

from services.stack.launcher import THREAD_VARIABLES, Services, StackConfig


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


@pytest.mark.parametrize("name", THREAD_VARIABLES)
def test_the_worker_leaves_a_core_to_the_services_unless_told_otherwise(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    for variable in THREAD_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    assert _services().worker_env()["TOLLGATE_RESERVED_CORES"] == "1"
    # Set by the caller, in the stack's extra variables or the environment: left alone.
    assert "TOLLGATE_RESERVED_CORES" not in _services(**{name: "2"}).worker_env()
    monkeypatch.setenv(name, "2")
    assert "TOLLGATE_RESERVED_CORES" not in _services().worker_env()
