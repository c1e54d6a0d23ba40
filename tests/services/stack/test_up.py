"""`tollgate up` and `make run`'s demo as a user runs them: everything started from
nothing but the package, on infrastructure of their own."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sqlalchemy.engine import make_url

from tollgate import AdminClient, Client
from tollgate.errors import UnauthenticatedError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SERVICES = {"admission", "scheduler", "worker", "ledger"}


def fresh_machine_env() -> dict[str, str]:
    """No TOLLGATE_* settings: the stack starts its own PostgreSQL and broker."""
    return {name: value for name, value in os.environ.items() if not name.startswith("TOLLGATE_")}


def wait_for_file(path: Path, process: subprocess.Popen[bytes], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, f"tollgate up exited with {process.returncode}"
        assert time.monotonic() < deadline, f"no {path} after {timeout:.0f}s"
        time.sleep(0.2)
    time.sleep(0.2)  # written in one go; let the writer close it


def wait_for_file_content(
    path: Path, process: subprocess.Popen[bytes], timeout: float = 180
) -> None:
    """Waits until `path` holds more than the `{}` a test left there."""
    deadline = time.monotonic() + timeout
    while not path.exists() or path.read_text().strip() in ("", "{}"):
        assert process.poll() is None, f"tollgate up exited with {process.returncode}"
        assert time.monotonic() < deadline, f"no {path} after {timeout:.0f}s"
        time.sleep(0.2)


@contextlib.contextmanager
def start_up(tmp_path: Path, *flags: str) -> Iterator[subprocess.Popen[bytes]]:
    """`tollgate up` on `tmp_path/stack`, its output in `tmp_path/out` and `err`."""
    command = [sys.executable, "-m", "tollgate.cli", "up", "--data-dir", str(tmp_path / "stack")]
    with open(tmp_path / "out", "wb") as out, open(tmp_path / "err", "wb") as err:
        yield subprocess.Popen([*command, *flags], stdout=out, stderr=err, env=fresh_machine_env())


def is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_tollgate_up_serves_describes_itself_and_stops_cleanly(tmp_path: Path) -> None:
    data_dir = tmp_path / "stack"
    stack_file = data_dir / "stack.json"
    # Left readable by an earlier run: written private all the same.
    data_dir.mkdir()
    stack_file.write_text("{}")
    stack_file.chmod(0o644)
    with start_up(tmp_path, "--port", "0") as process:
        try:
            wait_for_file_content(stack_file, process)
            stack: dict[str, Any] = json.loads(stack_file.read_text())
            assert stat.S_IMODE(stack_file.stat().st_mode) == 0o600
            for key in ("gateway", "admin_token", "api_key", "database_url", "kafka_bootstrap"):
                assert stack[key], key
            assert stack["model"] == "tiny"
            assert set(stack["services"]) == SERVICES
            processes = [p for replicas in stack["services"].values() for p in replicas]
            assert len(processes) == len(SERVICES)
            pids = [p["pid"] for p in processes]
            assert all(p["address"] for p in processes)
            assert all(is_running(pid) for pid in pids)
            assert stack["gateways"] == [stack["gateway"]]
            # The admin token reaches only the services with public ports.
            for name, replicas in stack["services"].items():
                environ = psutil.Process(replicas[0]["pid"]).environ()
                has_token = environ.get("TOLLGATE_ADMIN_TOKEN") == stack["admin_token"]
                assert has_token == (name in ("admission", "ledger")), name
                assert name in ("admission", "ledger") or "TOLLGATE_ADMIN_TOKEN" not in environ

            ledger = stack["services"]["ledger"][0]["address"]
            client = Client(stack["gateway"], stack["api_key"], ledger_address=ledger)
            events = list(client.generate("Once upon a time", model="tiny", max_tokens=8))
            assert [e.kind for e in events][-2:] == ["completed", "billed"]
            admin = AdminClient(stack["gateway"], stack["admin_token"])
            assert "demo" in {tenant.name for tenant in admin.list_tenants()}
        finally:
            process.send_signal(signal.SIGTERM)
            status = process.wait(90)
    assert status == 0
    assert not stack_file.exists()
    deadline = time.monotonic() + 10
    while any(is_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(is_running(pid) for pid in pids)
    # The secrets are in stack.json alone: not printed, not logged.
    printed = (tmp_path / "out").read_text() + (tmp_path / "err").read_text()
    logged = "".join(log.read_text(errors="replace") for log in (data_dir / "logs").glob("*.log"))
    password = make_url(stack["database_url"]).password
    assert password
    for secret in (stack["api_key"], stack["admin_token"], password):
        assert secret not in printed and secret not in logged
    assert stack["gateway"] in printed


def test_tollgate_up_puts_the_engine_it_is_given_behind_the_workers(tmp_path: Path) -> None:
    stack_file = tmp_path / "stack" / "stack.json"
    with start_up(tmp_path, "--port", "0", "--http-port", "0", "--engine-kind", "sim") as process:
        try:
            wait_for_file_content(stack_file, process)
            stack: dict[str, Any] = json.loads(stack_file.read_text())
            assert stack["engine"] == {"kind": "sim", "url": ""}
            [worker] = stack["services"]["worker"]
            assert psutil.Process(worker["pid"]).environ()["TOLLGATE_ENGINE_KIND"] == "sim"
            client = Client(stack["gateway"], stack["api_key"])
            events = list(client.generate("simulated", model="tiny", max_tokens=8))
            assert [e.kind for e in events][-2:] == ["completed", "billed"]
            assert sum(len(e.token_ids) for e in events) == 8
        finally:
            process.send_signal(signal.SIGTERM)
            assert process.wait(90) == 0


def test_an_engine_url_and_a_remote_kind_go_together(tmp_path: Path) -> None:
    for flags in (("--engine-kind", "vllm"), ("--engine-url", "http://127.0.0.1:9")):
        with start_up(tmp_path, *flags) as process:
            assert process.wait(60) == 2
        assert (
            "--engine-url goes with --engine-kind"
            in (tmp_path / "out").read_text() + (tmp_path / "err").read_text()
        )


def test_the_demo_streams_resumes_cancels_and_prints_the_ledger(tmp_path: Path) -> None:
    demo = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.stack.demo",
            "--exit",
            "--data-dir",
            str(tmp_path / "stack"),
        ],
        capture_output=True,
        text=True,
        timeout=280,
        env=fresh_machine_env(),
    )
    assert demo.returncode == 0, demo.stderr[-3000:]
    lines = demo.stdout.splitlines()
    assert any(line.startswith("[connection cut after seq") for line in lines)
    ends = [line.split("] ", 1)[1] for line in lines if line.startswith("[seq ")]
    # Each run's events other than tokens: the first to its end, the second cancelled.
    assert ends[:4] == ["queued", "prefill", "completed", "billed"]
    assert ends[4].startswith("cancelled output_tokens=") and ends[5:] == ["billed"]
    assert int(ends[4].split("=")[1]) > 0
    assert any(line.startswith("tenant total, every run so far: ") for line in lines)
    if "model smollm2-135m-instruct" in demo.stdout:  # else the registry was out of reach
        assert "Paris" in demo.stdout
    assert sum(" micro-USD" in line for line in lines) >= 6  # three entries for each run


def test_tollgate_up_runs_replicas_and_restarts_a_process_that_dies(tmp_path: Path) -> None:
    data_dir = tmp_path / "stack"
    stack_file = data_dir / "stack.json"
    replicas = "admission=2,scheduler=2,worker=2,ledger=2"
    with start_up(tmp_path, "--port", "0", "--http-port", "0", "--replicas", replicas) as process:
        try:
            wait_for_file_content(stack_file, process)
            stack: dict[str, Any] = json.loads(stack_file.read_text())
            assert {name: len(p) for name, p in stack["services"].items()} == dict.fromkeys(
                SERVICES, 2
            )
            assert stack["gateways"] == [p["address"] for p in stack["services"]["admission"]]
            client = Client(stack["gateways"], stack["api_key"])
            for i in range(4):
                events = list(client.generate(f"run {i}", model="tiny", max_tokens=8))
                assert [e.kind for e in events][-2:] == ["completed", "billed"]

            killed = stack["services"]["worker"][0]["pid"]
            os.kill(killed, signal.SIGKILL)
            restarted = wait_for_new_pid(stack_file, "worker", killed)
            assert is_running(restarted)
            events = list(client.generate("after", model="tiny", max_tokens=8))
            assert [e.kind for e in events][-2:] == ["completed", "billed"]
        finally:
            process.send_signal(signal.SIGTERM)
            status = process.wait(90)
    assert status == 0
    assert "worker restarted" in (tmp_path / "err").read_text()


def wait_for_new_pid(stack_file: Path, service: str, old_pid: int, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid = int(json.loads(stack_file.read_text())["services"][service][0]["pid"])
        if pid != old_pid:
            return pid
        time.sleep(0.2)
    raise AssertionError(f"{service} was not restarted")


def stack_of(stack_file: Path) -> dict[str, Any]:
    stack: dict[str, Any] = json.loads(stack_file.read_text())
    return stack


def answers_serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=0.5
            )
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def is_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.timeout(420)
def test_a_second_start_revokes_the_demo_key_of_the_first(tmp_path: Path) -> None:
    stack_file = tmp_path / "stack" / "stack.json"
    with start_up(tmp_path, "--port", "0", "--http-port", "0") as process:
        try:
            wait_for_file_content(stack_file, process)
            first = stack_of(stack_file)["api_key"]
        finally:
            process.send_signal(signal.SIGTERM)
            assert process.wait(90) == 0
    with start_up(tmp_path, "--port", "0", "--http-port", "0") as process:
        try:
            wait_for_file_content(stack_file, process)
            stack = stack_of(stack_file)
            assert stack["api_key"] != first
            with pytest.raises(UnauthenticatedError):
                list(Client(stack["gateway"], first).generate("hi", model="tiny", max_tokens=4))
            ledger = stack["services"]["ledger"][0]["address"]
            client = Client(stack["gateway"], stack["api_key"], ledger_address=ledger)
            events = list(client.generate("hi", model="tiny", max_tokens=4))
            assert [e.kind for e in events][-2:] == ["completed", "billed"]
        finally:
            process.send_signal(signal.SIGTERM)
            assert process.wait(90) == 0


def test_a_restarted_service_is_in_the_stack_file_as_soon_as_it_serves(tmp_path: Path) -> None:
    stack_file = tmp_path / "stack" / "stack.json"
    with start_up(tmp_path, "--port", "0", "--http-port", "0") as process:
        try:
            wait_for_file_content(stack_file, process)
            [scheduler] = stack_of(stack_file)["services"]["scheduler"]
            old_pid, address = scheduler["pid"], scheduler["address"]
            os.kill(old_pid, signal.SIGKILL)
            while not is_gone(old_pid):
                time.sleep(0.05)
            serving_since = None
            deadline = time.monotonic() + 60
            while stack_of(stack_file)["services"]["scheduler"][0]["pid"] == old_pid:
                assert time.monotonic() < deadline, "not restarted"
                if serving_since is None and answers_serving(address):
                    serving_since = time.monotonic()
                time.sleep(0.1)
            recorded = time.monotonic()
            # Not once it also holds its Kafka partitions: after a SIGKILL that waits for
            # the broker to give up on the dead consumer, far longer than this.
            assert serving_since is None or recorded - serving_since < 5
            [restarted] = stack_of(stack_file)["services"]["scheduler"]
            assert restarted["address"] == address
            assert "services.scheduler" in psutil.Process(restarted["pid"]).cmdline()
            assert answers_serving(address)
        finally:
            process.send_signal(signal.SIGTERM)
            assert process.wait(90) == 0


def test_a_stop_during_a_restart_ends_it_and_the_stack_at_once(tmp_path: Path) -> None:
    stack_file = tmp_path / "stack" / "stack.json"
    with start_up(tmp_path, "--port", "0", "--http-port", "0") as process:
        up = psutil.Process(process.pid)
        started: set[int] = set()
        try:
            wait_for_file_content(stack_file, process)
            old_pid = stack_of(stack_file)["services"]["scheduler"][0]["pid"]
            os.kill(old_pid, signal.SIGKILL)
            deadline = time.monotonic() + 60
            while not [p for p in up.children() if p.pid != old_pid and is_scheduler(p)]:
                assert time.monotonic() < deadline, "no new scheduler"
                time.sleep(0.05)
            time.sleep(0.5)  # it starts up: the restart is under way
            started |= {p.pid for p in up.children(recursive=True)}
        finally:
            process.send_signal(signal.SIGTERM)
        stop_requested = time.monotonic()
        while process.poll() is None and time.monotonic() < stop_requested + 90:
            with contextlib.suppress(psutil.Error):
                started |= {p.pid for p in up.children(recursive=True)}
            time.sleep(0.05)
        stopped_after = time.monotonic() - stop_requested
        status = process.wait(90)
    assert status == 0
    # Not once the new scheduler is ready, which waits for its Kafka partitions.
    assert stopped_after < 15
    deadline = time.monotonic() + 5
    while not all(is_gone(pid) for pid in started) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in started if not is_gone(pid)] == []


def is_scheduler(process: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        return "services.scheduler" in process.cmdline()
    return False


@pytest.mark.slow
def test_a_stop_while_the_stack_starts_ends_it_at_once(tmp_path: Path) -> None:
    logs = tmp_path / "stack" / "logs"
    with start_up(tmp_path, "--port", "0", "--http-port", "0") as process:
        up = psutil.Process(process.pid)
        started: set[int] = set()
        deadline = time.monotonic() + 120
        # Stopped once the first service runs, long before the last is ready.
        while not (logs / "ledger.log").exists():
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        started |= {p.pid for p in up.children(recursive=True)}
        process.send_signal(signal.SIGTERM)
        stop_requested = time.monotonic()
        status = process.wait(90)
        stopped_after = time.monotonic() - stop_requested
    assert status == 0
    assert stopped_after < 10
    deadline = time.monotonic() + 5
    while not all(is_gone(pid) for pid in started) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in started if not is_gone(pid)] == []
