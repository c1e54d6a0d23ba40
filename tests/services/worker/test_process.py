"""`python -m services.worker` as the launcher runs it: its engine steps in a child
process, which the worker replaces when it dies (tests/services/worker/test_engine_loss.py)."""

from __future__ import annotations

from pathlib import Path

import grpc
import psutil

from services.worker.app import ENGINE_NICENESS
from services.worker.threads import SPIN_ROUNDS
from tests.services.processes import service_process
from tests.services.worker.running import ready_engine, worker_env
from tollgate.v1 import worker_pb2, worker_pb2_grpc

# The worker's defaults for its engine process, checked below.
DEFAULTS_UNDER_TEST = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "TOLLGATE_ENGINE_NICE")


async def test_the_engine_process_runs_with_the_workers_defaults_and_so_does_its_successor(
    database_url: str, kafka_bootstrap: str, tiny_model_dir: Path
) -> None:
    env = worker_env(database_url, kafka_bootstrap, tiny_model_dir)
    for name in DEFAULTS_UNDER_TEST:
        env.pop(name, None)
    async with service_process("worker", env) as (process, address):
        async with grpc.aio.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            status = await stub.GetWorkerStatus(worker_pb2.GetWorkerStatusRequest())
            assert status.num_total_blocks == status.num_free_blocks == 64
            worker = psutil.Process(process.pid)
            engine = await ready_engine(worker, stub)
            _assert_defaults(worker, engine)
            engine.kill()
            _assert_defaults(worker, await ready_engine(worker, stub, dead_pid=engine.pid))
        assert process.returncode is None


def _assert_defaults(worker: psutil.Process, engine: psutil.Process) -> None:
    assert engine.environ().get("GOMP_SPINCOUNT") == SPIN_ROUNDS
    assert engine.nice() == worker.nice() + ENGINE_NICENESS
