"""A light tenant's interactive TTFT alone and during another tenant's flood of runs.

    python -m bench.fairness [--flood-runs 200] [--samples 40] [--quick] [--model NAME]

Starts the four services (`bench.stack_sides.running_stack`, as `bench.isolation` does)
on a tiny random Llama (or `--model`, e.g. smollm2-135m-instruct), and two tenants of the
same weight. The light tenant sends
interactive Generate requests one after another, a few tokens each, and times each to
its first token (`bench.isolation.quiet_ttfts`). First alone; then while the flooding
tenant, in a process of its own, keeps `--flood-runs` runs in flight, half of them batch
and half interactive, each followed by another as soon as it ends, far more than the
worker's KV cache holds at once. The scheduler's fair queuing should put each light run
ahead of the flood's backlog within a few dispatches, so its TTFT grows only by the time
a flood run takes to free its blocks and by the busier engine steps. The ratios of the
flooded to the lone TTFT at p50 and p99 are the figures (targets <= 1.5 and <= 2); each
TTFT is also split where its run's events arrive (admission, the scheduler's queue, the
engine), to tell a queue that is unfair from a machine that is busy; the flood reports how
long its own runs waited in the queue, per class, once all of them were in flight.

The flood's quota lets every run and stream in (0 = unlimited): fairness, not a quota,
has to protect the light tenant. The last line is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import Counter
from dataclasses import dataclass
from multiprocessing.synchronize import Event as EventType
from pathlib import Path
from queue import Queue
from typing import Any

from bench.isolation import on_tiny_stack, quiet_timings, tenant_key, ttfts_beside
from bench.report import percentile, progress
from bench.stack_sides import (
    MODEL_NAME,
    RequestTiming,
    make_stack_workload,
    run_stack_bench,
    warm_up,
)
from engine.tokenizer import Tokenizer
from tollgate import AsyncClient
from tollgate.errors import TollgateError

P50_RATIO_TARGET = 1.5
P99_RATIO_TARGET = 2.0
LIGHT_PROMPT_TOKENS = 24
LIGHT_MAX_TOKENS = 4
REFUSED_PAUSE_S = 0.5
SUSPENDED_LOG = "run suspended for another tenant's"


@dataclass(frozen=True, slots=True)
class Flood:
    """What the flooding tenant keeps in flight: `num_runs` runs of `max_tokens`, every
    other one batch."""

    gateway: str
    api_key: str
    num_runs: int
    max_tokens: int


def flood(plan: Flood, reports: Queue[dict[str, Any]], stop: EventType) -> None:
    """The flooding tenant, in a process of its own: tells `reports` once every one of its
    runs was queued, keeps them coming until `stop`, then cancels the ones in flight and
    reports how many runs of each class it completed and how many were refused."""
    asyncio.run(_flood(plan, reports, stop))


async def _flood(plan: Flood, reports: Queue[dict[str, Any]], stop: EventType) -> None:
    counts: Counter[str] = Counter()
    waits: dict[str, list[float]] = {"interactive": [], "batch": []}
    in_flight: dict[int, str] = {}
    queued = asyncio.Event()
    async with AsyncClient(plan.gateway, plan.api_key) as client:

        async def keep_one_going(slot: int) -> None:
            priority = "batch" if slot % 2 else "interactive"
            while True:
                stream = client.generate(
                    f"flood {slot} {counts[priority]}",
                    model=MODEL_NAME,
                    max_tokens=plan.max_tokens,
                    temperature=0,
                    ignore_eos=True,
                    priority=priority,
                    disconnect_grace=1.0,
                )
                queued_at = 0.0
                tokens = 0
                try:
                    async with stream:
                        async for event in stream:
                            if event.kind == "streaming":
                                tokens += len(event.token_ids)
                            elif event.kind == "completed":
                                # Suspended runs included: each token reaches its client once.
                                counts["tokens_checked"] += 1
                                if event.usage is None or tokens != event.usage.output_tokens:
                                    counts["tokens_mismatched"] += 1
                            elif event.kind == "queued":
                                queued_at = time.perf_counter()
                                in_flight[slot] = event.run_id
                                counts["queued"] += 1
                                if counts["queued"] >= plan.num_runs:
                                    queued.set()
                            elif event.kind == "prefill" and queued.is_set():
                                waits[priority].append(1000 * (time.perf_counter() - queued_at))
                    counts[f"{priority}_ended"] += 1
                except TollgateError as error:
                    counts[f"{priority}_refused_{type(error).__name__}"] += 1
                    await asyncio.sleep(REFUSED_PAUSE_S)
                in_flight.pop(slot, None)

        started = time.perf_counter()
        tasks = [asyncio.create_task(keep_one_going(slot)) for slot in range(plan.num_runs)]
        await queued.wait()
        reports.put({"seconds_to_queue": round(time.perf_counter() - started, 2)})
        full, ended_before = time.perf_counter(), counts["tokens_checked"]
        await asyncio.to_thread(stop.wait)
        # Its pace while the light tenant measured: what fairness may cost it.
        pace = (counts["tokens_checked"] - ended_before) / (time.perf_counter() - full)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for run_id in list(in_flight.values()):
            await client.cancel_run(run_id)
    # How long the flood's own runs waited in the scheduler's queue once it was full.
    queue_p50 = {f"{k}_queue_p50_ms": round(percentile(v, 50), 1) for k, v in waits.items() if v}
    reports.put({**counts, **queue_p50, "completed_per_second": round(pace, 2)})


def _queued_progress(started: dict[str, Any]) -> None:
    progress(f"flood: every run queued after {started['seconds_to_queue']} s")


async def measure(
    args: argparse.Namespace, gateway: str, api_key: str, admin: str
) -> dict[str, Any]:
    prompts = make_stack_workload(
        Tokenizer.from_model_dir(args.model_dir),
        1,
        LIGHT_PROMPT_TOKENS,
        LIGHT_MAX_TOKENS,
        args.seed,
        2 * args.samples,
    ).prompts
    plan = Flood(
        gateway, await tenant_key(gateway, admin, "flood", 0), args.flood_runs, args.flood_tokens
    )
    async with AsyncClient(gateway, api_key) as client:
        await warm_up(client, prompts[0])
        progress("the light tenant alone")
        alone = await quiet_timings(client, prompts[: args.samples])
        progress("the light tenant during the flood")
        during, started, ended = await ttfts_beside(
            client, flood, plan, prompts[args.samples :], _queued_progress
        )
    return report(args, alone, during, {**started, **ended})


# A light run's TTFT in three parts, as its client reads the run's events: submit to
# `queued` (admission), `queued` to `prefill` (the scheduler's queue and the dispatch to a
# worker) and `prefill` to the first token (the worker's engine).
PARTS = {
    "admission": lambda t: t.queued - t.submitted,
    "queue": lambda t: t.prefill - t.queued,
    "engine": lambda t: t.first_token - t.prefill,
    # Of `queue`, the time between the two events' stored times: the rest is the time the
    # prefill event took to reach the client.
    "stored queue": lambda t: t.stored_queue_wait,
}


def _p50_parts(timings: list[RequestTiming]) -> dict[str, float]:
    return {
        name: round(percentile([part(t) * 1000 for t in timings], 50), 2)
        for name, part in PARTS.items()
    }


def report(
    args: argparse.Namespace,
    alone_timings: list[RequestTiming],
    during_timings: list[RequestTiming],
    flood: dict[str, Any],
) -> dict[str, Any]:
    alone = [t.ttft_ms for t in alone_timings]
    during = [t.ttft_ms for t in during_timings]
    parts = {"alone": _p50_parts(alone_timings), "during": _p50_parts(during_timings)}
    print(f"{'light tenant':<28}{'samples':>8}{'ttft p50':>10}{'ttft p99':>10}"
          + "".join(f"{name + ' p50':>15}" for name in PARTS))  # fmt: skip
    for name, ttfts, split in (
        ("alone", alone, parts["alone"]),
        (f"during {args.flood_runs} flood runs", during, parts["during"]),
    ):
        print(
            f"{name:<28}{len(ttfts):>8}{percentile(ttfts, 50):>10.1f}{percentile(ttfts, 99):>10.1f}"
            + "".join(f"{split[part]:>15.1f}" for part in PARTS)
        )
    slowest = sorted(during_timings, key=lambda t: t.ttft_ms)[-3:]
    print("slowest during the flood: " + "; ".join(
        f"{t.ttft_ms:.0f} ms (" + ", ".join(
            f"{name} {part(t) * 1000:.0f}" for name, part in PARTS.items()) + ")"
        for t in reversed(slowest)
    ))  # fmt: skip
    p50 = percentile(during, 50) / percentile(alone, 50)
    p99 = percentile(during, 99) / percentile(alone, 99)
    print(f"TTFT during the flood / alone: p50 {p50:.2f} (target <= {P50_RATIO_TARGET}), "
          f"p99 {p99:.2f} (target <= {P99_RATIO_TARGET})")  # fmt: skip
    return {
        "flood_runs": args.flood_runs,
        "flood_tokens": args.flood_tokens,
        "samples": args.samples,
        "flood": flood,
        "alone_ttft_p50_ms": round(percentile(alone, 50), 2),
        "alone_ttft_p99_ms": round(percentile(alone, 99), 2),
        "flood_ttft_p50_ms": round(percentile(during, 50), 2),
        "flood_ttft_p99_ms": round(percentile(during, 99), 2),
        "ttft_p50_parts_ms": parts,
        "ttft_p50_ratio": round(p50, 3),
        "ttft_p99_ratio": round(p99, 3),
        "meets_target": p50 <= P50_RATIO_TARGET and p99 <= P99_RATIO_TARGET,
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", help="a model to serve instead of the tiny random one (smollm2-135m-instruct)"
    )
    parser.add_argument("--flood-runs", type=int, default=200, help="runs the flood keeps going")
    parser.add_argument("--flood-tokens", type=int, default=64, help="output tokens of each")
    parser.add_argument("--samples", type=int, help="light requests per side (default 40)")
    parser.add_argument("--quick", action="store_true", help="fewer samples (16)")
    parser.add_argument("--kv-blocks", type=int, default=300)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-batched-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")
    parser.add_argument("--logs", type=Path, help="keep the services' logs in this directory")
    args = parser.parse_args()
    args.samples = args.samples or (16 if args.quick else 40)
    if args.flood_runs < 2:
        parser.error("--flood-runs must be at least 2: batch and interactive")
    return args


def bench(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    args.logs = args.logs or scratch / "logs"
    result = on_tiny_stack(args, scratch, measure)
    # The flood's runs suspended to make room for the light tenant's (the worker logs each).
    result["flood"]["suspended"] = sum(
        path.read_text(errors="replace").count(SUSPENDED_LOG)
        for path in args.logs.glob("worker*.log")
    )
    flood = result["flood"]
    progress(
        f"flood: {flood['suspended']} runs suspended; of {flood.get('tokens_checked', 0)} "
        f"completed, {flood.get('tokens_mismatched', 0)} with other than their tokens once"
    )
    return result


def main() -> int:
    return run_stack_bench(bench, parse_args(), "fairness")


if __name__ == "__main__":
    sys.exit(main())
