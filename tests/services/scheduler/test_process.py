"""`python -m services.scheduler` as the launcher runs it."""

import asyncio
import os
import signal

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.core.event_store import EventStore
from tests.services.processes import service_process
from tests.services.scheduler.helpers import queue_run, wait_for
from tollgate.v1 import scheduler_pb2, scheduler_pb2_grpc


async def test_the_process_announces_itself_dispatches_and_stops_on_sigterm(
    database_url: str, kafka_bootstrap: str, kafka_topic: str, store: EventStore, fake_workers
) -> None:
    worker = await fake_workers("w1")
    env = {
        **os.environ,
        "TOLLGATE_DATABASE_URL": database_url,
        "TOLLGATE_KAFKA_BOOTSTRAP": kafka_bootstrap,
        "TOLLGATE_TOPIC": kafka_topic,
        "TOLLGATE_LISTEN": "127.0.0.1:0",
        "TOLLGATE_WORKERS": f"w1={worker.address}",
        "TOLLGATE_SCHEDULER_RESCAN": "0.3",
        "TOLLGATE_HEARTBEAT_INTERVAL": "0.2",
    }
    async with service_process("scheduler", env) as (process, address):
        async with grpc.aio.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            reply = await health.Check(
                health_pb2.HealthCheckRequest(service="tollgate.v1.SchedulerService")
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            run_id = await queue_run(store)
            await wait_for(lambda: worker.assignment(run_id))
            stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)

            async def running_on_its_one_worker() -> bool:
                # The scheduler counts the run once AssignRun has returned to it, a moment
                # after the worker received the call.
                stats = await stub.GetQueueStats(scheduler_pb2.GetQueueStatsRequest())
                return (stats.num_running, stats.num_workers) == (1, 1)

            await wait_for(running_on_its_one_worker, timeout=10)

        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 30) == 0
        assert process.stdout is not None
        assert await process.stdout.read() == b""  # READY is the only line
