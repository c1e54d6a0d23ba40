"""PostgreSQL itself restarted (the server stopped and started again, not only its
sessions ended) under a stack with runs streaming and runs queued: every service
reconnects, the queued runs are dispatched afterwards, and every run ends billed once."""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path

import pytest

from services.core import migrate
from services.stack.infra import (
    DATABASE_URL_ENV,
    KAFKA_BOOTSTRAP_ENV,
    Endpoints,
    LocalInfra,
    create_database,
)
from tests.e2e.conftest import ADMIN_TOKEN, running_stack, stored_seqs
from tests.e2e.test_restarts import OPTIONS, RETRY
from tollgate import AdminClient, Client
from tollgate.cli import main as tollgate
from tollgate.types import RunEvent

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NUM_RUNS = 8
# 38 blocks each: four fit the worker's 160, the other four wait in the queue.
MAX_TOKENS = 600
TEMPLATE = "e2e_template"


def restart_postgres(local: LocalInfra, down_seconds: float) -> None:
    # The one server this LocalInfra launched (the broker is the session's).
    [postgres] = local._servers
    postgres.stop()
    time.sleep(down_seconds)
    postgres.start()


def test_runs_streaming_and_queued_through_a_postgres_restart_end_billed_once(
    infra: Endpoints, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if os.environ.get(DATABASE_URL_ENV):
        pytest.skip("restarts the embedded PostgreSQL; an external one is configured")
    monkeypatch.setenv(KAFKA_BOOTSTRAP_ENV, infra.kafka_bootstrap)
    # Not under pytest's basetemp, which a concurrent pytest run may prune (tests/conftest.py).
    with tempfile.TemporaryDirectory(prefix="tollgate-pg-restart-") as data_dir:
        run_through_restart(LocalInfra(Path(data_dir)), tiny_model_dir)


def run_through_restart(local: LocalInfra, tiny_model_dir: Path) -> None:
    with local as endpoints:
        migrate.upgrade(create_database(endpoints.database_url, TEMPLATE))
        with running_stack(endpoints, TEMPLATE, tiny_model_dir) as (stack, _):
            key = stack.tenant_key("pg-restart")
            client = Client(
                stack.gateway, key, ledger_address=stack.ledger, retry=RETRY, options=OPTIONS
            )
            results: dict[int, list[RunEvent]] = {}
            streaming = threading.Event()

            def run(i: int) -> None:
                events = []
                for event in client.generate(
                    f"story {i}", model="tiny", max_tokens=MAX_TOKENS, ignore_eos=True
                ):
                    events.append(event)
                    if event.kind == "streaming":
                        streaming.set()
                results[i] = events

            threads = [threading.Thread(target=run, args=(i,)) for i in range(NUM_RUNS)]
            for thread in threads:
                thread.start()
            assert streaming.wait(60)
            restart_postgres(local, down_seconds=3.0)
            for thread in threads:
                thread.join(240)

            assert sorted(results) == list(range(NUM_RUNS))
            for events in results.values():
                assert stored_seqs(events) == list(range(1, len(stored_seqs(events)) + 1))
                assert [e.kind for e in events][-2:] == ["completed", "billed"]
                streamed = sum(len(e.token_ids) for e in events if e.kind == "streaming")
                assert streamed == MAX_TOKENS
            after = list(client.generate("after", model="tiny", max_tokens=8))
            assert [e.kind for e in after][-2:] == ["completed", "billed"]
            admin = AdminClient(stack.gateway, ADMIN_TOKEN, ledger_address=stack.ledger)
            assert admin.get_reconciliation().ok
            assert tollgate(["reconcile", "--database-url", stack.database_url]) == 0
