import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from services.stack import launcher
from services.stack.launcher import THREAD_VARIABLES, Services, StackConfig, parse_replicas
from services.stack.supervisor import MAX_BACKOFF_S, STABLE_AFTER_S, Backoff


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
def test_the_worker_leaves_a_core_to_the_services_on_machines_of_4_cores_or_more(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    for variable in THREAD_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(launcher, "physical_cores", lambda: 4)
    assert _services().worker_env()["TOLLGATE_RESERVED_CORES"] == "1"
    # Set by the caller, in the stack's extra variables or the environment: left alone.
    assert "TOLLGATE_RESERVED_CORES" not in _services(**{name: "2"}).worker_env()
    monkeypatch.setenv(name, "2")
    assert "TOLLGATE_RESERVED_CORES" not in _services().worker_env()


def test_on_fewer_cores_the_engine_keeps_them_all(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in THREAD_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(launcher, "physical_cores", lambda: 3)
    assert "TOLLGATE_RESERVED_CORES" not in _services().worker_env()


def test_hyperthreads_of_one_core_count_once(tmp_path: Path) -> None:
    for cpu, siblings in enumerate(["0,2", "1,3", "0,2", "1,3", "4"]):
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "core_cpus_list").write_text(siblings + "\n")
    assert launcher.physical_cores(range(5), tmp_path) == 3
    assert launcher.physical_cores([0, 2], tmp_path) == 1
    # No topology for a CPU: it counts as a core of its own.
    assert launcher.physical_cores([0, 7, 8], tmp_path) == 3
    # Kernels before 5.3 name the list thread_siblings_list.
    for cpu in (7, 8):
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "thread_siblings_list").write_text("7-8\n")
    assert launcher.physical_cores([0, 7, 8], tmp_path) == 2
    assert 1 <= launcher.physical_cores() <= len(os.sched_getaffinity(0))


# A launcher process: starts the stand-in service with ServiceProcess, prints its pid.
LAUNCHER = """
import sys, time
from pathlib import Path
from services.stack.launcher import ServiceProcess
service = ServiceProcess("follower", "tests.services.stack.follower", {}, Path(sys.argv[1]))
service.start()
print("PID", service.pid, flush=True)
time.sleep(60)
"""


def test_a_service_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    log = tmp_path / "follower.log"
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(log)], stdout=subprocess.PIPE, text=True
    )
    assert launcher.stdout is not None
    pid_line = next(line for line in launcher.stdout if line.startswith("PID "))  # past its log
    service = psutil.Process(int(pid_line.split()[1]))
    deadline = time.monotonic() + 30
    while not log.exists() or not log.read_text().endswith("\n"):
        assert time.monotonic() < deadline, "the stand-in service never started"
        time.sleep(0.05)
    # The variable is gone once read: the service's own children are not tied to its parent.
    assert log.read_text() == "None\n"
    launcher.kill()
    launcher.wait()
    service.wait(timeout=10)  # psutil.TimeoutExpired if it outlived its launcher


@pytest.fixture
def stand_in(tmp_path: Path) -> Iterator[launcher.ServiceProcess]:
    """A service process that never prints READY."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOLLGATE_")}
    process = launcher.ServiceProcess(
        "follower", "tests.services.stack.follower", env, tmp_path / "follower.log"
    )
    yield process
    process.stop()


def test_a_stop_request_ends_the_wait_for_ready(stand_in: launcher.ServiceProcess) -> None:
    stand_in.start()
    stopping = threading.Event()
    threading.Timer(0.5, stopping.set).start()
    started = time.monotonic()
    with pytest.raises(launcher.Stopped):
        stand_in.wait_ready(timeout=120, stopping=stopping)
    assert time.monotonic() - started < 5
    assert stand_in.exit_status() is None  # stopping it is the caller's


def test_a_restarted_process_is_ready_once_its_address_serves(
    stand_in: launcher.ServiceProcess,
) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        stand_in.address = f"127.0.0.1:{port}"  # where it listened before
        started = time.monotonic()
        assert stand_in.restart() == f"127.0.0.1:{port}"  # without a READY line
        assert time.monotonic() - started < 30
        assert stand_in.env["TOLLGATE_LISTEN"] == f"127.0.0.1:{port}"
    finally:
        server.stop(None)


def test_replicas_are_counted_per_service() -> None:
    assert parse_replicas("") == {"admission": 1, "scheduler": 1, "worker": 1, "ledger": 1}
    assert parse_replicas("admission=2, worker=3") == {
        "admission": 2,
        "scheduler": 1,
        "worker": 3,
        "ledger": 1,
    }
    for bad in ("gateway=2", "worker=0", "worker", "worker=two"):
        with pytest.raises(ValueError, match="NAME=N"):
            parse_replicas(bad)


def test_replicas_get_names_of_their_own() -> None:
    services = _services()
    services.replicas["worker"] = 3
    names = [f"worker{suffix}" for suffix in ("", "-2", "-3")]
    for index, name in enumerate(names):
        process = launcher.ServiceProcess(name, "services.worker", {}, Path("/tmp/x"), "worker")
        services.processes[name] = process
        assert services.of("worker")[index] is process
    assert services.admission_env(1, ["s1:1", "s2:2"])["TOLLGATE_SCHEDULER_ADDRESS"] == "s2:2"
    assert services.admission_env(0, ["s1:1"])["TOLLGATE_LISTEN"] == "127.0.0.1:0"


def test_a_process_that_keeps_dying_waits_longer_each_time() -> None:
    backoff = Backoff(started_at=0.0)
    delays = [backoff.next_delay(now) for now in (1.0, 2.0, 3.0, 4.0)]
    assert delays == [0.5, 1.0, 2.0, 4.0]
    for now in range(5, 20):
        backoff.next_delay(float(now))
    assert backoff.delay == MAX_BACKOFF_S
    backoff.started(100.0)
    assert backoff.next_delay(100.0 + STABLE_AFTER_S) == 0.5  # it stayed up: forgiven


def test_a_service_that_exits_before_it_is_ready_ends_the_wait_at_once(tmp_path: Path) -> None:
    """Not after the whole ready timeout: a supervisor restarting it would stall meanwhile."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOLLGATE_")}
    process = launcher.ServiceProcess(
        "ledger", "services.ledger", env, tmp_path / "ledger.log"
    )  # no TOLLGATE_DATABASE_URL: it exits with status 2
    process.start()
    started = time.monotonic()
    with pytest.raises(launcher.InfraError, match="exited with status 2"):
        process.wait_ready(timeout=120)
    assert time.monotonic() - started < 30


def test_only_the_public_services_are_given_the_admin_token_and_tls_files(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Also when the launching shell has them: only what the launcher gives passes on.
    for name in launcher.PUBLIC_ONLY_VARIABLES:
        monkeypatch.setenv(name, f"inherited {name}")
    services = Services(
        StackConfig(
            database_url="postgresql://db/x",
            kafka_bootstrap="127.0.0.1:9092",
            model_name="tiny",
            model_dir=Path("/models/tiny"),
            admin_token="a-long-enough-admin-token",
            tls_cert=Path("/tls/cert.pem"),
            tls_key=Path("/tls/key.pem"),
        ),
        Path("/tmp/logs"),
    )
    envs = {
        "scheduler": services.common_env(),
        "worker": {**services.common_env(), **services.worker_env()},
        "ledger": {**services.common_env(), **services.public_env()},
        "admission": {**services.common_env(), **services.admission_env(0, ["s:1"])},
    }
    children = {
        name: launcher.ServiceProcess(name, f"services.{name}", env, Path("/tmp/x.log")).child_env()
        for name, env in envs.items()
    }
    for name in ("scheduler", "worker"):
        assert not set(launcher.PUBLIC_ONLY_VARIABLES) & set(children[name]), name
        assert children[name]["TOLLGATE_INTERNAL_TOKEN"] == services.config.internal_token
    for name in ("ledger", "admission"):
        assert children[name]["TOLLGATE_ADMIN_TOKEN"] == "a-long-enough-admin-token", name
        assert children[name]["TOLLGATE_TLS_CERT"] == "/tls/cert.pem"
        assert children[name]["TOLLGATE_TLS_KEY"] == "/tls/key.pem"
