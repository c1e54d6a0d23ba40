"""One tenant floods admission with streams: another tenant's TTFT with and without it.

    python -m bench.isolation [--streams 300] [--samples 40] [--flood-runs 10] [--quick]

Starts the four services (`bench.stack_sides.running_stack`, as `bench.stack` does) on a
tiny random Llama, and three tenants. A blocker's long run takes all but a few of the
worker's KV blocks for the whole measurement. The quiet tenant sends Generate requests one
after another, a few tokens each (they fit in the blocks left), and times each to its
first token. The flooding tenant holds `--streams` streams open: `--flood-runs` Generate
streams of runs that need more blocks than the blocker leaves, which therefore stay
queued (as the runs of the flood that prompted this did), and StreamRun streams on those
runs for the rest. The flood runs in a process of its own, so reading its streams does
not slow this one's client. The quiet tenant's TTFT is measured without the flood, then
during it, in the same stack, the blocker running throughout; the ratio of the two
medians is the figure (target <= 1.5).

The flood's quota lets every stream in (`max_concurrent_streams` = 0): that measures what
holding them costs everyone else. `--default-quota` leaves the tenant at the admission
default instead, which refuses the streams past it.
The last line is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from multiprocessing.synchronize import Event as EventType
from pathlib import Path
from queue import Queue
from typing import Any

import grpc
from google.protobuf import duration_pb2

from bench.models import model_dir as bench_model_dir
from bench.report import percentile, progress
from bench.stack_sides import (
    MODEL_NAME,
    RequestTiming,
    make_stack_workload,
    run_stack_bench,
    running_stack,
    stack_request,
    warm_up,
)
from engine.model_dirs.tiny import init_tiny_model
from engine.tokenizer import Tokenizer
from tollgate import AsyncAdminClient, AsyncClient
from tollgate.v1 import events_pb2, gateway_pb2, gateway_pb2_grpc

TINY_SHAPE: dict[str, Any] = {"layers": 4, "hidden": 256, "heads": 8, "kv_heads": 4, "vocab": 512}
TTFT_RATIO_TARGET = 1.5
QUIET_MAX_TOKENS = 4
FLOOD_OPEN_TIMEOUT_S = 120.0
SKIP_SECONDS = "TOLLGATE_SCHEDULER_MAX_SKIP_SECONDS"


@dataclass(frozen=True, slots=True)
class Flood:
    """What the flooding tenant opens: `num_streams` streams, of which `num_runs` are the
    Generate streams of runs of `max_tokens` (too many for the worker's KV cache) and
    the rest StreamRun streams on those runs."""

    gateway: str
    api_key: str
    num_streams: int
    num_runs: int
    max_tokens: int


def flood(plan: Flood, reports: Queue[dict[str, Any]], stop: EventType) -> None:
    """The flooding tenant, in a process of its own: opens the streams, tells `reports`
    how many opened, holds them until `stop`, then cancels its runs."""
    asyncio.run(_flood(plan, reports, stop))


async def _flood(plan: Flood, reports: Queue[dict[str, Any]], stop: EventType) -> None:
    metadata = (("authorization", f"Bearer {plan.api_key}"),)
    num_runs, max_tokens = plan.num_runs, plan.max_tokens
    async with grpc.aio.insecure_channel(plan.gateway) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        started = time.perf_counter()
        generates = [
            stub.Generate(_waiting_run(i, max_tokens), metadata=metadata) for i in range(num_runs)
        ]
        run_ids = [(await call.read()).run_id for call in generates]
        followers = [
            stub.StreamRun(
                gateway_pb2.StreamRunRequest(run_id=run_ids[i % num_runs]), metadata=metadata
            )
            for i in range(plan.num_streams - num_runs)
        ]
        firsts = await asyncio.gather(*(call.read() for call in followers), return_exceptions=True)
        held = generates + [c for c, f in zip(followers, firsts, strict=True) if _opened(f)]
        readers = [asyncio.create_task(_drain(call)) for call in held]
        reports.put(
            {
                "opened": len(held),
                "refused": sum(_refused(first) for first in firsts),
                "open_seconds": time.perf_counter() - started,
            }
        )
        await asyncio.to_thread(stop.wait)
        still_open = sum(not reader.done() for reader in readers)
        for call in held:
            call.cancel()
        for run_id in run_ids:
            await stub.CancelRun(gateway_pb2.CancelRunRequest(run_id=run_id), metadata=metadata)
        reports.put({"still_open": still_open})


def _waiting_run(i: int, max_tokens: int, grace: int = 5) -> events_pb2.GenerateRequest:
    return events_pb2.GenerateRequest(
        model=MODEL_NAME,
        prompt=f"flood {i}",
        sampling=events_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        disconnect_grace=duration_pb2.Duration(seconds=grace),
    )


async def start_blocker(gateway: str, api_key: str, max_tokens: int) -> str:
    """Starts the long run that holds most of the worker's blocks; returns its id once it
    streams. Its stream is closed then: the run goes on for its grace."""
    metadata = (("authorization", f"Bearer {api_key}"),)
    async with grpc.aio.insecure_channel(gateway) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        call = stub.Generate(_waiting_run(-1, max_tokens, grace=600), metadata=metadata)
        while (event := await call.read()).WhichOneof("kind") != "streaming":
            pass
        call.cancel()
    return str(event.run_id)


async def blocker_state(gateway: str, api_key: str, run_id: str, cancel: bool = False) -> str:
    """The blocker's state (`streaming` while it holds the blocks); cancelled if asked."""
    async with AsyncClient(gateway, api_key) as client:
        run = await (client.cancel_run(run_id) if cancel else client.get_run(run_id))
    return str(run.state)


def _opened(first: object) -> bool:
    return not isinstance(first, BaseException) and first is not grpc.aio.EOF


def _refused(first: object) -> bool:
    return (
        isinstance(first, grpc.aio.AioRpcError)
        and first.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    )


async def _drain(call: Any) -> None:
    while await call.read() != grpc.aio.EOF:
        pass


async def tenant_key(gateway: str, admin_token: str, name: str, streams: int | None) -> str:
    """A new tenant's key; `streams` its max_concurrent_streams (None: the default)."""
    async with AsyncAdminClient(gateway, admin_token) as admin:
        tenant = await admin.create_tenant(f"bench-{name}-{time.monotonic_ns()}")
        if streams is not None:
            await admin.set_quota(tenant.tenant_id, max_concurrent_streams=streams)
        return (await admin.create_api_key(tenant.tenant_id)).secret


async def quiet_timings(client: AsyncClient, prompts: list[str]) -> list[RequestTiming]:
    """Each prompt's request timed, one request at a time."""
    return [await stack_request(client, p, QUIET_MAX_TOKENS) for p in prompts]


async def quiet_ttfts(client: AsyncClient, prompts: list[str]) -> list[float]:
    """Each prompt's TTFT in milliseconds, one request at a time."""
    return [timing.ttft_ms for timing in await quiet_timings(client, prompts)]


async def measure(
    args: argparse.Namespace, gateway: str, api_key: str, admin: str
) -> dict[str, Any]:
    model_prompts = make_stack_workload(
        Tokenizer.from_model_dir(args.model_dir),
        1,
        24,
        QUIET_MAX_TOKENS,
        args.seed,
        2 * args.samples,
    ).prompts
    baseline_prompts, flood_prompts = model_prompts[: args.samples], model_prompts[args.samples :]
    key = await tenant_key(gateway, admin, "flood", None if args.default_quota else 0)
    blocker_key = await tenant_key(gateway, admin, "blocker", None)
    plan = Flood(gateway, key, args.streams, args.flood_runs, args.flood_tokens)
    alone: list[float] = []
    during: list[float] = []
    async with AsyncClient(gateway, api_key) as client:
        await warm_up(client, baseline_prompts[0][:24])
        blocker = ""
        held = 0
        # Alone and flooded in turns, so that load elsewhere on the machine weighs on both.
        for turn in range(args.rounds):
            if not blocker or await blocker_state(gateway, blocker_key, blocker) != "streaming":
                blocker = await start_blocker(gateway, blocker_key, args.blocker_tokens)
            progress(f"round {turn + 1}: the quiet tenant alone")
            alone += await quiet_ttfts(client, baseline_prompts[turn :: args.rounds])
            timings, opened, closed = await flooded_ttfts(
                client, plan, flood_prompts[turn :: args.rounds]
            )
            during += [timing.ttft_ms for timing in timings]
            # Had it ended, the flood's runs would have streamed: another measurement.
            held += await blocker_state(gateway, blocker_key, blocker) == "streaming"
        closed["rounds_blocked"] = held
        await blocker_state(gateway, blocker_key, blocker, cancel=True)
    return report(args, alone, during, opened, closed)


async def flooded_ttfts(
    client: AsyncClient, plan: Flood, prompts: list[str]
) -> tuple[list[RequestTiming], dict[str, Any], dict[str, Any]]:
    """The prompts' timings while a flood process holds its streams; with what it reported
    once they were open and once it closed them."""
    return await ttfts_beside(client, flood, plan, prompts, _opened_progress)


def _opened_progress(opened: dict[str, Any]) -> None:
    progress(f"flood: {opened['opened']} streams open, {opened['refused']} refused")


async def ttfts_beside(
    client: AsyncClient,
    target: Callable[[Any, Queue[dict[str, Any]], EventType], None],
    plan: object,
    prompts: list[str],
    on_started: Callable[[dict[str, Any]], None],
) -> tuple[list[RequestTiming], dict[str, Any], dict[str, Any]]:
    """The prompts' timings while `target(plan, reports, stop)` runs in a process of its own
    (so reading its streams does not slow this one's client); measured once it reports it
    started (`on_started` is told what), and with what it reports once `stop` ends it."""
    context = multiprocessing.get_context("spawn")
    reports: Queue[dict[str, Any]] = context.Queue()  # type: ignore[assignment]
    stop = context.Event()
    process = context.Process(target=target, args=(plan, reports, stop))
    process.start()
    try:
        started = await asyncio.to_thread(reports.get, timeout=FLOOD_OPEN_TIMEOUT_S)
        on_started(started)
        timings = await quiet_timings(client, prompts)
    finally:
        stop.set()
    ended = await asyncio.to_thread(reports.get, timeout=FLOOD_OPEN_TIMEOUT_S)
    await asyncio.to_thread(process.join, 30)
    return timings, started, ended


def report(
    args: argparse.Namespace,
    baseline: list[float],
    flooded: list[float],
    opened: dict[str, Any],
    closed: dict[str, Any],
) -> dict[str, Any]:
    print(f"{'quiet tenant':<24}{'samples':>8}{'ttft p50':>10}{'ttft p90':>10}{'ttft p99':>10}")
    sides = (("alone", baseline), (f"during {opened['opened']} streams", flooded))
    for name, ttfts in sides:
        cells = "".join(f"{percentile(ttfts, q):>10.1f}" for q in (50, 90, 99))
        print(f"{name:<24}{len(ttfts):>8}{cells}")
    ratio = percentile(flooded, 50) / percentile(baseline, 50)
    print(f"TTFT p50 during the flood / alone: {ratio:.2f} (target <= {TTFT_RATIO_TARGET})")
    return {
        "streams_asked": args.streams,
        "streams_open": opened["opened"],
        "streams_refused": opened["refused"],
        "streams_still_open_at_end": closed["still_open"],
        "rounds_with_the_flood_queued_throughout": closed["rounds_blocked"],
        "seconds_to_open": round(opened["open_seconds"], 2),
        "flood_runs": args.flood_runs,
        "default_quota": args.default_quota,
        "samples": args.samples,
        "rounds": args.rounds,
        "alone_ttft_p50_ms": round(percentile(baseline, 50), 2),
        "alone_ttft_p99_ms": round(percentile(baseline, 99), 2),
        "flood_ttft_p50_ms": round(percentile(flooded, 50), 2),
        "flood_ttft_p99_ms": round(percentile(flooded, 99), 2),
        "ttft_p50_ratio": round(ratio, 3),
        "meets_target": ratio <= TTFT_RATIO_TARGET,
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=300, help="streams of the flood")
    parser.add_argument("--flood-runs", type=int, default=10, help="queued runs they follow")
    parser.add_argument("--samples", type=int, help="quiet requests per side (default 40)")
    parser.add_argument("--quick", action="store_true", help="fewer samples (16)")
    parser.add_argument("--rounds", type=int, default=4, help="turns of alone, then flooded")
    parser.add_argument(
        "--default-quota",
        action="store_true",
        help="leave the flooding tenant at the default max_concurrent_streams",
    )
    # The blocker's run takes all but a few of --kv-blocks; a flood run of --flood-tokens
    # does not fit in those, a quiet request does.
    parser.add_argument("--kv-blocks", type=int, default=300)
    parser.add_argument("--blocker-tokens", type=int, default=4470)
    parser.add_argument("--flood-tokens", type=int, default=400)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-batched-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")
    parser.add_argument("--logs", type=Path, help="keep the services' logs in this directory")
    args = parser.parse_args()
    args.samples = args.samples or (16 if args.quick else 40)
    if not 1 <= args.rounds <= args.samples:
        parser.error("--rounds must be between 1 and --samples")
    if not 1 <= args.flood_runs <= args.streams:
        parser.error("--flood-runs must be between 1 and --streams")
    left = args.kv_blocks * args.block_size - args.blocker_tokens
    if not 0 < left < args.flood_tokens:
        parser.error("--blocker-tokens must leave fewer tokens of --kv-blocks than --flood-tokens")
    return args


def bench(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    # Long enough for the blocker; no flood run waits long enough to hold up smaller ones.
    env = {"TOLLGATE_MAX_TOKENS": str(args.blocker_tokens), SKIP_SECONDS: "3600"}
    return on_tiny_stack(args, scratch, measure, env)


Measure = Callable[[argparse.Namespace, str, str, str], Awaitable[dict[str, Any]]]


def on_tiny_stack(
    args: argparse.Namespace,
    scratch: Path,
    measure: Measure,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """`measure(args, gateway, api_key, admin_token)` on the four services serving a tiny
    random Llama, or the model `args.model` names where it has one (`args.model_dir`),
    with `env` in their environment."""
    if getattr(args, "model", None):
        args.model_dir = bench_model_dir(args.model, scratch)
    else:
        progress("generating the tiny model")
        args.model_dir = init_tiny_model(scratch / "model", **TINY_SHAPE)
    log_dir = args.logs or scratch / "logs"
    progress(f"starting the stack (logs in {log_dir})")
    with running_stack(scratch, args.model_dir, args, log_dir, env) as running:
        work = measure(args, running.gateway, running.api_key, running.admin_token)
        return asyncio.run(asyncio.wait_for(work, args.timeout))


def main() -> int:
    return run_stack_bench(bench, parse_args(), "isolation")


if __name__ == "__main__":
    sys.exit(main())
