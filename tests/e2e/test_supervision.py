"""A supervised stack with two schedulers survives a SIGKILL of each of its processes in
turn, without anyone starting them again: the run in flight ends, billed, and the next
one completes."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.stack.infra import Endpoints
from services.stack.launcher import Services
from services.stack.supervisor import Supervisor
from tests.e2e.conftest import ADMIN_TOKEN, Stack, running_stack, stored_seqs
from tollgate import AdminClient, Client
from tollgate.types import RetryPolicy

MODEL = "tiny"
# Patient enough to outlast admission's restart, reconnecting quickly.
RETRY = RetryPolicy(max_attempts=200, initial_backoff=0.1, max_backoff=0.5)
OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 500)]
RESTART_TIMEOUT_S = 60.0

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


@pytest.fixture(scope="module")
def supervised(
    infra: Endpoints, template_database: str, tiny_model_dir: Path
) -> Iterator[tuple[Stack, Services, Supervisor]]:
    env = {"TOLLGATE_WORKER_TIMEOUT": "2"}
    replicas = {"scheduler": 2}
    with running_stack(infra, template_database, tiny_model_dir, env, replicas=replicas) as (
        stack,
        services,
    ):
        supervisor = Supervisor(services)
        supervisor.start()
        try:
            yield stack, services, supervisor
        finally:
            supervisor.stop()


def wait_restarted(supervisor: Supervisor, num_restarts: int) -> None:
    deadline = time.monotonic() + RESTART_TIMEOUT_S
    while supervisor.num_restarts == num_restarts:
        assert time.monotonic() < deadline, "not restarted"
        time.sleep(0.1)


@pytest.mark.parametrize("name", ["scheduler", "worker", "ledger", "admission", "scheduler-2"])
def test_the_stack_survives_a_sigkill_of_each_process(
    supervised: tuple[Stack, Services, Supervisor], name: str
) -> None:
    stack, services, supervisor = supervised
    client = Client(
        stack.gateway,
        stack.tenant_key(f"kill-{name}"),
        ledger_address=stack.ledger,
        retry=RETRY,
        options=OPTIONS,
    )
    in_flight = iter(client.generate("in flight", model=MODEL, max_tokens=300, ignore_eos=True))
    seen = [next(in_flight)]
    while seen[-1].kind not in ("streaming", "completed"):
        seen.append(next(in_flight))
    victim = services.processes[name]
    old_pid, address, restarts = victim.pid, victim.address, supervisor.num_restarts

    os.kill(old_pid, signal.SIGKILL)
    seen.extend(in_flight)
    wait_restarted(supervisor, restarts)

    assert supervisor.num_restarts == restarts + 1
    assert victim.pid != old_pid and victim.exit_status() is None
    assert victim.address == address  # the others and the clients find it where it was
    assert stored_seqs(seen) == list(range(1, len(stored_seqs(seen)) + 1))
    # A worker's death fails what it streamed; anything else lets the run complete.
    assert [e.kind for e in seen][-2:] in (["completed", "billed"], ["failed", "billed"])
    after = list(client.generate("after", model=MODEL, max_tokens=8))
    assert [e.kind for e in after][-2:] == ["completed", "billed"]
    admin = AdminClient(stack.gateway, ADMIN_TOKEN, ledger_address=stack.ledger)
    assert admin.get_reconciliation().ok
