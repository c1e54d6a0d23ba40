"""The real worker in this process: WorkerService over WorkerCore and its StepAppender,
the engine in its child process (`ProcessEngine`) as the worker runs it. Runs are queued
as admission queues them and leased as the scheduler does.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil

from engine.config import EngineConfig
from engine.process_engine import ProcessEngine
from services.core.event_store import EventStore
from services.core.server import create_server
from services.worker.appender import StepAppender
from services.worker.core import WorkerCore, resume_suspended
from services.worker.runs import AssignedRun
from services.worker.servicer import WorkerServicer
from tests.services.scheduler.helpers import queue_run, wait_for
from tollgate.v1 import events_pb2, worker_pb2, worker_pb2_grpc

MODEL = "tiny"
BLOCK_SIZE = 16
PROMPT = (1, 2, 3)


@dataclass
class RunningWorker:
    worker_id: str
    address: str
    stub: worker_pb2_grpc.WorkerServiceStub


@contextlib.asynccontextmanager
async def running_worker(
    store: EventStore,
    model_dir: Path,
    *,
    worker_id: str = "worker-1",
    num_kv_blocks: int = 64,
    adapters: dict[str, Path] | None = None,
) -> AsyncIterator[RunningWorker]:
    served = tuple((name, str(path)) for name, path in (adapters or {}).items())
    config = EngineConfig(block_size=BLOCK_SIZE, num_kv_blocks=num_kv_blocks, adapters=served)
    runs: dict[str, AssignedRun] = {}
    appender = StepAppender(store, runs, lambda run_id: engine.abort(run_id))
    engine = await ProcessEngine.start(model_dir, config, appender.on_step)
    core = WorkerCore(
        worker_id,
        MODEL,
        engine,
        store,
        appender.start,
        runs,
        drop_run=appender.drop,
        adapters=[name for name, _ in served],
    )
    server, port, _ = create_server(
        "127.0.0.1:0",
        lambda s: worker_pb2_grpc.add_WorkerServiceServicer_to_server(WorkerServicer(core), s),
    )
    await server.start()
    tasks = [
        asyncio.create_task(appender.run()),
        asyncio.create_task(resume_suspended(core, appender.watch_ended())),
    ]
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield RunningWorker(
            worker_id, f"127.0.0.1:{port}", worker_pb2_grpc.WorkerServiceStub(channel)
        )
    finally:
        await channel.close()
        await server.stop(0)
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await engine.shutdown()


def worker_env(
    database_url: str, kafka_bootstrap: str, model_dir: Path, **variables: str
) -> dict[str, str]:
    """The environment of `python -m services.worker` serving the tiny model with 64 blocks,
    this process's with `variables` on top."""
    return {
        **os.environ,
        "TOLLGATE_DATABASE_URL": database_url,
        "TOLLGATE_KAFKA_BOOTSTRAP": kafka_bootstrap,
        "TOLLGATE_LISTEN": "127.0.0.1:0",
        "TOLLGATE_MODELS": f"{MODEL}={model_dir}",
        "TOLLGATE_KV_BLOCKS": "64",
        **variables,
    }


async def leased_run(
    store: EventStore, worker_id: str, max_tokens: int, tenant_id: str = "t1"
) -> worker_pb2.AssignRunRequest:
    """A run queued and leased to `worker_id` as the scheduler leases it: the AssignRun
    the scheduler would send."""
    run_id = await queue_run(store, tenant_id, max_tokens=max_tokens, prompt=PROMPT)
    epoch = await store.acquire_lease(run_id, worker_id)
    return assignment(run_id, max_tokens, tenant_id, lease_epoch=epoch)


def assignment(
    run_id: str, max_tokens: int, tenant_id: str = "t1", lease_epoch: int = 1, last_seq: int = 1
) -> worker_pb2.AssignRunRequest:
    return worker_pb2.AssignRunRequest(
        run_id=run_id,
        tenant_id=tenant_id,
        model=MODEL,
        prompt_token_ids=PROMPT,
        sampling=events_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        priority=events_pb2.PRIORITY_INTERACTIVE,
        lease_epoch=lease_epoch,
        last_seq=last_seq,
    )


def engine_of(worker: psutil.Process) -> psutil.Process | None:
    """The worker's engine child; None while it has none (a dead one may linger unreaped)."""
    for child in worker.children():
        with contextlib.suppress(psutil.ZombieProcess, psutil.NoSuchProcess):
            if "spawn_main" in " ".join(child.cmdline()):
                return child
    return None


async def ready_engine(
    worker: psutil.Process, stub: worker_pb2_grpc.WorkerServiceStub, dead_pid: int = 0
) -> psutil.Process:
    """The worker's engine once the worker takes runs again (after `dead_pid` died)."""

    async def ready() -> psutil.Process | None:
        status = await stub.GetWorkerStatus(worker_pb2.GetWorkerStatusRequest())
        engine = engine_of(worker)
        fresh = engine is not None and engine.pid != dead_pid
        return engine if fresh and not status.draining and status.num_free_blocks else None

    engine: psutil.Process = await wait_for(ready, timeout=60)
    return engine
