import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.core.event_store import EventStore
from services.core.runs import RunState
from tests.services.core.kafka_tools import wait_for
from tests.services.ledger.runs import create_tenant, terminal_run
from tollgate.v1 import ledger_pb2, ledger_pb2_grpc

ADMIN_TOKEN = "ledger-admin-token"


@pytest.fixture
def ledger_process(
    database_url: str, kafka_bootstrap: str, kafka_topic: str
) -> Iterator[tuple[subprocess.Popen[str], str]]:
    env = {
        **os.environ,
        "TOLLGATE_DATABASE_URL": database_url,
        "TOLLGATE_KAFKA_BOOTSTRAP": kafka_bootstrap,
        "TOLLGATE_TOPIC": kafka_topic,
        "TOLLGATE_LISTEN": "127.0.0.1:0",
        "TOLLGATE_ADMIN_TOKEN": ADMIN_TOKEN,
        "TOLLGATE_PRICES": '{"*": {"input_tokens": 3}}',
        # Only the consumer may bill here: the sweep waits far longer than the test.
        "TOLLGATE_LEDGER_SWEEP_GRACE": "600",
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "services.ledger"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        ready = process.stdout.readline().split()
        assert ready[:1] == ["READY"], process.stderr.read() if process.stderr else ""
        yield process, ready[1]
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


async def test_the_process_serves_bills_and_stops_on_sigterm(
    ledger_process: tuple[subprocess.Popen[str], str], store: EventStore
) -> None:
    process, address = ledger_process
    tenant, key = await create_tenant(store.db)
    run_id = await terminal_run(store, tenant)

    async with grpc.aio.insecure_channel(address) as channel:
        health = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="tollgate.v1.LedgerService")
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING

        async def billed() -> bool:
            view = await store.get_run(run_id)
            return view is not None and view.state == RunState.BILLED

        await wait_for(billed, timeout=30)
        usage = await ledger_pb2_grpc.LedgerServiceStub(channel).GetUsage(
            ledger_pb2.GetUsageRequest(), metadata=[("authorization", f"Bearer {key}")]
        )
    assert usage.num_runs == 1 and usage.lines[0].amount_micros == 3 * 6

    process.send_signal(signal.SIGTERM)
    code = await asyncio.to_thread(process.wait, 20)
    assert code == 0
    assert process.stderr is not None
    logs = [json.loads(line) for line in process.stderr.read().splitlines() if line.startswith("{")]
    assert {"event": "serving", "address": address}.items() <= next(
        log for log in logs if log.get("event") == "serving"
    ).items()
