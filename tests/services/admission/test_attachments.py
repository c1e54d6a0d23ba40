"""Disconnect grace across admission replicas: a run counts as attached while any replica
streams it, for as long as the stream lasts (tests/e2e/test_restarts.py kills one)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
from google.protobuf import duration_pb2

from services.core.runs import RunState
from tests.services.admission.running import MODEL, Admission, auth, running_admission
from tollgate.v1 import events_pb2, gateway_pb2

GRACE = duration_pb2.Duration(nanos=400_000_000)


def generate(grace: duration_pb2.Duration = GRACE) -> events_pb2.GenerateRequest:
    return events_pb2.GenerateRequest(
        model=MODEL,
        prompt="attached",
        sampling=events_pb2.SamplingParams(max_tokens=8),
        disconnect_grace=grace,
    )


async def state_after(admission: Admission, run_id: str, seconds: float) -> RunState | None:
    await asyncio.sleep(seconds)
    run = await admission.store.get_run(run_id)
    assert run is not None
    return run.state


async def wait_for_state(admission: Admission, run_id: str, state: RunState) -> None:
    for _ in range(200):
        run = await admission.store.get_run(run_id)
        if run is not None and run.state == state:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"run {run_id} never reached {state}")


async def test_a_stream_resumed_on_another_replica_keeps_the_run(
    admission: Admission,
    database_url: str,
    kafka_bootstrap: str,
    kafka_topic: str,
    tiny_model_dir: Path,
) -> None:
    _, key = await admission.new_tenant_key("replicas")
    async with running_admission(
        database_url, kafka_bootstrap, kafka_topic, tiny_model_dir
    ) as other:
        first = admission.gateway.Generate(generate(), metadata=auth(key))
        run_id = (await first.read()).run_id
        resumed = other.gateway.StreamRun(
            gateway_pb2.StreamRunRequest(run_id=run_id), metadata=auth(key)
        )
        assert (await resumed.read()).seq == 1
        first.cancel()  # the first replica's stream breaks; the second still streams
        assert await state_after(admission, run_id, 1.5) == RunState.QUEUED
        resumed.cancel()
        await wait_for_state(admission, run_id, RunState.CANCELLED)


async def test_a_stream_that_outlives_the_lease_keeps_the_run(
    database_url: str, kafka_bootstrap: str, kafka_topic: str, tiny_model_dir: Path
) -> None:
    async with running_admission(
        database_url, kafka_bootstrap, kafka_topic, tiny_model_dir, lease=0.5
    ) as short:
        _, key = await short.new_tenant_key("renewed")
        call = short.gateway.Generate(generate(), metadata=auth(key))
        run_id = (await call.read()).run_id
        assert await state_after(short, run_id, 3.0) == RunState.QUEUED
        call.cancel()
        await wait_for_state(short, run_id, RunState.CANCELLED)
        try:
            await call.read()
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass
