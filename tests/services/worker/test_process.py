"""`python -m services.worker` as the launcher runs it: its engine steps in a child
process, and the worker does not outlive that child."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import grpc
import psutil

from services.worker.app import ENGINE_NICENESS
from services.worker.threads import SPIN_ROUNDS
from tests.services.processes import service_process
from tollgate.v1 import worker_pb2, worker_pb2_grpc

# The worker's defaults for its engine process, checked below.
DEFAULTS_UNDER_TEST = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "TOLLGATE_ENGINE_NICE")


async def test_the_engine_process_runs_with_the_workers_defaults_and_its_death_ends_the_worker(
    database_url: str, kafka_bootstrap: str, tiny_model_dir: Path
) -> None:
    env = {
        **{k: v for k, v in os.environ.items() if k not in DEFAULTS_UNDER_TEST},
        "TOLLGATE_DATABASE_URL": database_url,
        "TOLLGATE_KAFKA_BOOTSTRAP": kafka_bootstrap,
        "TOLLGATE_LISTEN": "127.0.0.1:0",
        "TOLLGATE_MODELS": f"tiny={tiny_model_dir}",
        "TOLLGATE_KV_BLOCKS": "64",
    }
    async with service_process("worker", env) as (process, address):
        async with grpc.aio.insecure_channel(address) as channel:
            status = await worker_pb2_grpc.WorkerServiceStub(channel).GetWorkerStatus(
                worker_pb2.GetWorkerStatusRequest()
            )
            assert status.num_total_blocks == status.num_free_blocks == 64
        children = psutil.Process(process.pid).children()
        [engine] = [child for child in children if "spawn_main" in " ".join(child.cmdline())]
        assert engine.environ().get("GOMP_SPINCOUNT") == SPIN_ROUNDS
        assert engine.nice() == psutil.Process(process.pid).nice() + ENGINE_NICENESS
        engine.kill()
        assert await asyncio.wait_for(process.wait(), 30) == 1
