"""Services killed outright and started again, on the same address, while runs are in
flight: admission under a streaming client, which resumes; the ledger among completing
runs, which are all billed once; the scheduler, without which streams go on and new runs
wait; and the database, cut off for a while."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import psycopg
import pytest
from psycopg import sql
from sqlalchemy.engine import make_url

from services.core.db import libpq_url
from services.stack.infra import Endpoints
from services.stack.launcher import ServiceProcess, Services
from tests.e2e.conftest import ADMIN_TOKEN, Stack, running_stack, start_streaming, stored_seqs
from tests.services.worker.running import engine_of
from tollgate import AdminClient, Client
from tollgate.types import RetryPolicy, RunEvent

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
    listen = f"127.0.0.1:{unassigned_port()}"
    with running_stack(infra, template_database, tiny_model_dir, gateway_listen=listen) as started:
        yield started


def kill(services: Services, name: str) -> ServiceProcess:
    """Kills the service outright; returns what it was."""
    old = services.processes[name]
    os.killpg(old.pid, signal.SIGKILL)
    assert old.process is not None
    old.process.wait()
    return old


def start_again(services: Services, old: ServiceProcess) -> None:
    """Starts a killed service with the same settings, on the same address."""
    env = {**old.env, "TOLLGATE_LISTEN": old.address}
    new = ServiceProcess(old.name, old.module, env, old.log_path)
    services.processes[old.name] = new
    new.start()
    assert new.wait_ready() == old.address


def unassigned_port() -> int:
    """A free port below the range the kernel picks ports from (for port 0 and for
    outgoing connections), so nothing else takes it while the gateway is down."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.sample(range(10_000, low), 50):
        with socket.socket() as probe:
            with contextlib.suppress(OSError):
                probe.bind(("127.0.0.1", port))
                return port
    raise RuntimeError("no free port below the ephemeral range")


def restart(services: Services, name: str) -> None:
    start_again(services, kill(services, name))


def test_a_stream_survives_its_admission_process_dying(
    fixed_gateway: tuple[Stack, Services],
) -> None:
    stack, services = fixed_gateway
    key = stack.tenant_key("restart")
    client = Client(stack.gateway, key, ledger_address=stack.ledger, retry=RETRY, options=OPTIONS)
    seen, events = start_streaming(client, "a long story", 600)

    restart(services, "admission")
    seen.extend(events)

    assert stored_seqs(seen) == list(range(1, len(stored_seqs(seen)) + 1))
    assert [e.kind for e in seen][-2:] == ["completed", "billed"]
    assert sum(len(e.token_ids) for e in seen if e.kind == "streaming") == 600
    stored = list(Client(stack.gateway, key).stream_run(seen[0].run_id))
    assert [(e.seq, e.kind) for e in stored] == [(e.seq, e.kind) for e in seen if not e.live]
    assert [t for e in stored for t in e.token_ids] == [t for e in seen for t in e.token_ids]


def test_a_run_abandoned_when_its_admission_died_is_cancelled_after_it_is_back(
    fixed_gateway: tuple[Stack, Services],
) -> None:
    """The dead admission's lease on the run runs out, and the one started again cancels it."""
    stack, services = fixed_gateway
    key = stack.tenant_key("abandoned")
    client = Client(stack.gateway, key)
    events = iter(
        client.generate(
            "a story", model=MODEL, max_tokens=2000, ignore_eos=True, disconnect_grace=1.0
        )
    )
    run_id = next(events).run_id
    while next(events).kind != "streaming":
        pass
    engine = engine_of(psutil.Process(services.processes["worker"].pid))
    assert engine is not None
    engine.suspend()  # the run stays streaming for as long as the test needs
    try:
        dead = kill(services, "admission")
        client.close()  # the client does not come back
        start_again(services, dead)
        deadline = time.monotonic() + 60
        with Client(stack.gateway, key) as reader:
            while (run := reader.get_run(run_id)).state not in ("cancelled", "billed"):
                assert time.monotonic() < deadline, f"run still {run.state}"
                time.sleep(0.2)
    finally:
        engine.resume()
    with Client(stack.gateway, key) as reader:
        stored = list(reader.stream_run(run_id))
    cancelled = [e for e in stored if e.kind == "cancelled"]
    assert len(cancelled) == 1 and cancelled[0].cancel_reason == "client disconnected"


def test_the_ledger_killed_among_completing_runs_still_bills_each_once(
    fixed_gateway: tuple[Stack, Services],
) -> None:
    stack, services = fixed_gateway
    key = stack.tenant_key("ledger-crash")
    client = Client(stack.gateway, key)
    results: dict[int, list[RunEvent]] = {}
    completing = threading.Event()

    def run(i: int) -> None:
        events = []
        for event in client.generate(f"burst {i}", model=MODEL, max_tokens=24, ignore_eos=True):
            events.append(event)
            if event.kind == "completed":
                completing.set()
        results[i] = events

    threads = [threading.Thread(target=run, args=(i,)) for i in range(10)]
    for thread in threads:
        thread.start()
    # Billing has begun: the ledger dies among transactions and offset commits.
    assert completing.wait(120)
    restart(services, "ledger")
    for thread in threads:
        thread.join(120)

    assert len(results) == 10
    billing = Client(stack.gateway, key, ledger_address=stack.ledger)
    for events in results.values():
        assert [e.kind for e in events][-2:] == ["completed", "billed"]
        assert stored_seqs(events) == list(range(1, len(stored_seqs(events)) + 1))
        entries = billing.iter_ledger_entries(run_id=events[0].run_id)
        assert sorted(e.billing_type for e in entries) == [
            "cached_input_tokens",
            "input_tokens",
            "output_tokens",
        ]
    admin = AdminClient(stack.gateway, ADMIN_TOKEN, ledger_address=stack.ledger)
    assert admin.get_reconciliation().ok


def test_runs_go_on_while_the_scheduler_is_down_and_queue_until_it_is_back(
    fixed_gateway: tuple[Stack, Services],
) -> None:
    stack, services = fixed_gateway
    key = stack.tenant_key("scheduler-crash")
    client = Client(stack.gateway, key, ledger_address=stack.ledger)
    running = iter(client.generate("running", model=MODEL, max_tokens=400, ignore_eos=True))
    seen = [next(running)]
    while seen[-1].kind != "streaming":
        seen.append(next(running))

    scheduler = kill(services, "scheduler")
    # Admitted while no scheduler listens: it waits in the store.
    waiting = iter(client.generate("waiting", model=MODEL, max_tokens=16, ignore_eos=True))
    queued = next(waiting)
    assert queued.kind == "queued"
    seen.extend(running)  # the worker streams on without the scheduler
    assert [e.kind for e in seen][-2:] == ["completed", "billed"]
    assert client.get_run(queued.run_id).state == "queued"

    start_again(services, scheduler)
    rest = [queued, *waiting]
    assert [e.kind for e in rest][-2:] == ["completed", "billed"]
    assert stored_seqs(rest) == list(range(1, len(stored_seqs(rest)) + 1))
    assert (
        AdminClient(stack.gateway, ADMIN_TOKEN, ledger_address=stack.ledger).get_reconciliation().ok
    )


def test_a_stream_outlasts_a_database_outage(
    fixed_gateway: tuple[Stack, Services], infra: Endpoints
) -> None:
    """Every connection of the stack's database is cut and none is let in for a while,
    as when PostgreSQL restarts: the engine keeps generating, the worker keeps what it
    cannot append, clients are told UNAVAILABLE and retry, and the run ends whole."""
    stack, _ = fixed_gateway
    key = stack.tenant_key("database-outage")
    client = Client(stack.gateway, key, ledger_address=stack.ledger, retry=RETRY, options=OPTIONS)
    seen, events = start_streaming(client, "outage", 600)

    database = make_url(stack.database_url).database
    assert database is not None
    with psycopg.connect(libpq_url(infra.database_url), autocommit=True) as admin:
        name = sql.Identifier(database)
        admin.execute(sql.SQL("ALTER DATABASE {} WITH ALLOW_CONNECTIONS false").format(name))
        try:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                (database,),
            )
            time.sleep(3)
        finally:
            admin.execute(sql.SQL("ALTER DATABASE {} WITH ALLOW_CONNECTIONS true").format(name))
    seen.extend(events)

    assert stored_seqs(seen) == list(range(1, len(stored_seqs(seen)) + 1))
    assert [e.kind for e in seen][-2:] == ["completed", "billed"]
    assert sum(len(e.token_ids) for e in seen if e.kind == "streaming") == 600
    after = list(client.generate("after", model=MODEL, max_tokens=8))
    assert [e.kind for e in after][-2:] == ["completed", "billed"]
    assert (
        AdminClient(stack.gateway, ADMIN_TOKEN, ledger_address=stack.ledger).get_reconciliation().ok
    )
