import subprocess
import sys
from pathlib import Path

import psutil
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


# The launcher's side: starts a child the way ServiceProcess does, prints its pid, waits.
LAUNCHER = """
import os, signal, subprocess, sys, time
from services.core.infra_process import die_with_parent_env
child = subprocess.Popen(
    [sys.executable, "-c", sys.argv[1]],
    env={**os.environ, **die_with_parent_env(signal.SIGTERM)},
)
print(child.pid, flush=True)
time.sleep(60)
"""
# A service's side: what each `services/*/__main__.py` does first.
SERVICE = """
import os, time
from services.core.infra_process import PARENT_ENV, follow_parent
follow_parent()
print(os.environ.get(PARENT_ENV), flush=True)
time.sleep(60)
"""


def test_a_service_dies_with_the_process_that_started_it() -> None:
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, SERVICE], stdout=subprocess.PIPE, text=True
    )
    assert launcher.stdout is not None
    service = psutil.Process(int(launcher.stdout.readline()))
    # The variable is gone once read: the service's own children are not tied to its parent.
    assert launcher.stdout.readline().strip() == "None"
    launcher.kill()
    launcher.wait()
    service.wait(timeout=10)  # psutil.TimeoutExpired if it outlived its launcher
