"""Disconnect grace across admission replicas: a run counts as attached while any replica
streams it, for as long as the stream lasts (tests/e2e/test_restarts.py kills one)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
from google.protobuf import duration_pb2

from services.admission.attachment_store import Attachments, attach_in
from services.core.runs import NewEvent, NewRun, RunState
from tests.services.admission.running import MODEL, Admission, auth, running_admission
from tollgate.v1 import events_pb2, gateway_pb2

GRACE = duration_pb2.Duration(nanos=400_000_000)
LEASE = 0.6


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


async def test_a_slow_cancel_never_holds_back_the_renewal_of_a_live_stream(
    admission: Admission,
) -> None:
    db, store = admission.db, admission.store
    for run_id in ("run_stuck", "run_live"):
        await store.append(run_id, 0, [NewEvent(RunState.QUEUED)], new_run=NewRun("t1", MODEL))
    async with db.begin() as conn:
        # A replica that died holding `run_stuck`: abandoned at once.
        await attach_in(conn, "run_stuck", "gone", grace=0.0, lease=0.0)
        await attach_in(conn, "run_live", "A", grace=0.1, lease=LEASE)
    here = Attachments(db, "A", lease=LEASE, renew_interval=0.2, sweep_interval=0.1)
    elsewhere = Attachments(db, "B", lease=LEASE, renew_interval=0.2, sweep_interval=0.1)
    abandoned_elsewhere: list[str] = []

    async def cancel_for_ever(run_id: str) -> None:
        await asyncio.Event().wait()  # a cancel that never returns

    async def noted(run_id: str) -> None:
        abandoned_elsewhere.append(run_id)

    async with here.attached("run_live", leased=True):
        tasks = [
            asyncio.create_task(here.run(cancel_for_ever)),
            asyncio.create_task(elsewhere.run(noted)),
        ]
        await asyncio.sleep(5 * LEASE)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert "run_stuck" in abandoned_elsewhere
    assert "run_live" not in abandoned_elsewhere
