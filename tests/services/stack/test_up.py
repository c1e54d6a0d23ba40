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

import psutil
import pytest
from sqlalchemy.engine import make_url

from tollgate import AdminClient, Client

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
