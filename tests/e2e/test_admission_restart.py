"""Admission killed while a client streams, then started again: the client resumes."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.core.infra import Endpoints, free_port
from services.stack.launcher import ServiceProcess, Services
from tests.e2e.conftest import Stack, running_stack
from tollgate import Client
from tollgate.types import RetryPolicy

MODEL = "tiny"
# Patient enough to outlast admission's restart (a few seconds), reconnecting quickly.
RETRY = RetryPolicy(max_attempts=100, initial_backoff=0.1, max_backoff=0.5)
OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 500)]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def fixed_gateway(
    infra: Endpoints, template_database: str, tiny_model_dir: Path
) -> Iterator[tuple[Stack, Services]]:
    """A stack of its own, its gateway on a port a restarted admission listens on again."""
    listen = f"127.0.0.1:{free_port()}"
    with running_stack(infra, template_database, tiny_model_dir, gateway_listen=listen) as started:
        yield started


def restart(services: Services, name: str) -> None:
    """Kills the service outright, then starts it again with the same settings."""
    old = services.processes[name]
    os.killpg(old.pid, signal.SIGKILL)
    assert old.process is not None
    old.process.wait()
    new = ServiceProcess(old.name, old.module, old.env, old.log_path)
    services.processes[name] = new
    new.start()
    new.wait_ready()


def test_a_stream_survives_its_admission_process_dying(
    fixed_gateway: tuple[Stack, Services],
) -> None:
    stack, services = fixed_gateway
    key = stack.tenant_key("restart")
    client = Client(stack.gateway, key, ledger_address=stack.ledger, retry=RETRY, options=OPTIONS)
    events = iter(client.generate("a long story", model=MODEL, max_tokens=600, ignore_eos=True))
    seen = [next(events)]
    while sum(e.kind == "streaming" for e in seen) < 2:
        seen.append(next(events))

    restart(services, "admission")
    seen.extend(events)

    assert [e.seq for e in seen] == list(range(1, len(seen) + 1))
    assert [e.kind for e in seen][-2:] == ["completed", "billed"]
    assert sum(len(e.token_ids) for e in seen if e.kind == "streaming") == 600
    stored = list(Client(stack.gateway, key).stream_run(seen[0].run_id))
    assert [(e.seq, e.kind, e.token_ids) for e in stored] == [
        (e.seq, e.kind, e.token_ids) for e in seen
    ]
