"""The whole stack against the same engine in-process: throughput and added TTFT.

    python -m bench.stack [--model NAME|56m|tiny] [--concurrency N] [--max-tokens M] [--rounds R] [--quick]
    python -m bench.stack --front http [...]   # the HTTP front door against gRPC (bench.stack_http)
    python -m bench.stack --telemetry [...]    # metrics and OTLP tracing on against off

Takes the real model where it is cached, or a random Llama (bench/models.py; `--model
tiny` is a 4-layer model whose steps cost little more than the engine's Python, so the
services' own cost per run shows), then runs one workload twice: N concurrent
greedy requests of M output tokens each (EOS ignored, so both sides produce
exactly N*M tokens) over a fixed, seeded prompt set; with R rounds, R such waves
one after another, each with prompts of its own. First in-process through
`ProcessEngine` (the engine front the worker uses, its steps in a child process),
which is then shut down; then through the four service processes
(`tollgate up`'s launcher, with its own PostgreSQL and broker, or those named by
TOLLGATE_DATABASE_URL / TOLLGATE_KAFKA_BOOTSTRAP) with the same EngineConfig,
streamed by `tollgate.AsyncClient`. Both sides share this machine's cores with
whatever else runs there; in the stack case that includes the services, the
database and the broker.

TTFT is measured as the caller sees it: from submitting a request to its first
output tokens (the first `streaming` event through the stack). Throughput is
all output tokens over the time from the first submit to the last request
finishing (`completed`, not `billed`), summed over rounds; the time to `billed`
is reported apart.
Each side also reports the CPU seconds its processes spent (by role: engine,
each service, postgres, broker, the bench itself) from its first submit to its
last request ending, against what the machine's cores offered over that time.
The last line is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import time
from pathlib import Path
from typing import Any

from bench.cpu import BENCH, ENGINE, CpuWindow
from bench.models import SYNTHETIC, add_model_option, model_name
from bench.models import model_dir as bench_model_dir
from bench.report import counts, progress
from bench.stack_http import report_fronts, run_fronts
from bench.stack_sides import (
    SideResult,
    StackWorkload,
    make_stack_workload,
    run_inprocess,
    run_stack,
    run_stack_bench,
    running_stack,
    workload_summary,
)
from bench.stack_telemetry import bench_telemetry
from engine.config import EngineConfig
from engine.tokenizer import Tokenizer

# The services' CPU is everything the stack runs but the engine's steps and this bench.
NOT_SERVICES = (ENGINE, BENCH)
IDLE_SECONDS = 10.0
THROUGHPUT_TARGET = 0.85
ADDED_TTFT_P50_TARGET_MS = 15.0


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        block_size=args.block_size,
        num_kv_blocks=args.kv_blocks,
        max_num_batched_tokens=args.max_batched_tokens,
    )


def report(
    model: str,
    work: StackWorkload,
    local: SideResult,
    stack: SideResult,
    config: EngineConfig,
    idle: CpuWindow,
) -> dict[str, Any]:
    header = f"{'side':<12}{'tokens':>8}{'seconds':>9}{'tok/s':>9}{'ttft p50':>10}{'ttft p99':>10}"
    print(f"{header}{'billed p50':>12}{'billed p99':>12}")
    for side in (local, stack):
        billed = (
            f"{side.billed_ms(50):>12.1f}{side.billed_ms(99):>12.1f}"
            if side is stack
            else f"{'-':>12}{'-':>12}"
        )
        print(
            f"{side.name:<12}{side.output_tokens:>8}{side.seconds:>9.2f}"
            f"{side.tokens_per_second:>9.1f}{side.ttft_ms(50):>10.1f}{side.ttft_ms(99):>10.1f}"
            + billed
        )
    ratio = stack.tokens_per_second / local.tokens_per_second
    added_p50 = stack.ttft_ms(50) - local.ttft_ms(50)
    added_p99 = stack.ttft_ms(99) - local.ttft_ms(99)
    print(
        f"stack/in-process throughput {ratio:.3f} (target >= {THROUGHPUT_TARGET}); "
        f"added TTFT p50 {added_p50:.1f} ms (target <= {ADDED_TTFT_P50_TARGET_MS:.0f}), "
        f"p99 {added_p99:.1f} ms"
    )
    for side in (local, stack):
        print(f"CPU seconds, {side.name}: {side.cpu.describe()}")
    runs = len(stack.timings)
    per_run = stack.cpu.ms_per_run(runs, exclude=NOT_SERVICES)
    idle_percent = idle.percent_of_a_core(exclude=NOT_SERVICES)
    print(
        f"services' CPU per run (all but the engine and this bench, to billed): "
        f"{sum(per_run.values()):.1f} ms ({_parts(per_run, 'ms')}); idle: "
        f"{sum(idle_percent.values()):.1f}% of a core ({_parts(idle_percent, '%')})"
    )
    same = sum(
        a.token_ids == b.token_ids for a, b in zip(local.timings, stack.timings, strict=True)
    )
    return {
        "model": model,
        **workload_summary(work),
        "num_kv_blocks": config.num_kv_blocks,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "inprocess_tokens_per_s": round(local.tokens_per_second, 1),
        "stack_tokens_per_s": round(stack.tokens_per_second, 1),
        "throughput_ratio": round(ratio, 3),
        "inprocess_ttft_p50_ms": round(local.ttft_ms(50), 2),
        "inprocess_ttft_p99_ms": round(local.ttft_ms(99), 2),
        "stack_ttft_p50_ms": round(stack.ttft_ms(50), 2),
        "stack_ttft_p99_ms": round(stack.ttft_ms(99), 2),
        "added_ttft_p50_ms": round(added_p50, 2),
        "added_ttft_p99_ms": round(added_p99, 2),
        "stack_billed_p50_ms": round(stack.billed_ms(50), 2),
        "stack_billed_p99_ms": round(stack.billed_ms(99), 2),
        "identical_outputs": same,
        "num_cores": stack.cpu.num_cores,
        "inprocess_cpu_s": local.cpu.rounded(),
        "stack_cpu_s": stack.cpu.rounded(),
        "inprocess_cpu_busy": round(local.cpu.busy_fraction, 3),
        "stack_cpu_busy": round(stack.cpu.busy_fraction, 3),
        "service_cpu_ms_per_run": round(sum(per_run.values()), 2),
        "service_cpu_ms_per_run_by_role": per_run,
        "idle_cpu_percent_of_a_core": round(sum(idle_percent.values()), 2),
        "idle_cpu_percent_by_role": idle_percent,
        "meets_throughput_target": ratio >= THROUGHPUT_TARGET,
        "meets_ttft_target": added_p50 <= ADDED_TTFT_P50_TARGET_MS,
    }


def _parts(values: dict[str, float], unit: str) -> str:
    return ", ".join(f"{role} {value:.1f}{unit}" for role, value in values.items())


def check_tokens(side: SideResult, work: StackWorkload) -> None:
    counts = {t.num_tokens for t in side.timings}
    if counts != {work.max_tokens}:
        raise RuntimeError(f"{side.name}: output lengths {sorted(counts)}, not {work.max_tokens}")


def bench(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    model_dir = bench_model_dir(args.model, scratch)
    if args.front == "http":
        return bench_fronts(args, scratch, model_dir)
    tokenizer = Tokenizer.from_model_dir(model_dir)
    works = {
        concurrency: make_stack_workload(
            tokenizer, concurrency, args.prompt_words, args.max_tokens, args.seed, args.rounds
        )
        for concurrency in args.concurrencies
    }
    if args.telemetry:
        return bench_telemetry(args, scratch, model_dir, works[args.concurrency])
    config = engine_config(args)
    waves = f" x {args.rounds} rounds" if args.rounds > 1 else ""
    local: dict[int, SideResult] = {}
    for concurrency, work in works.items():
        progress(f"in-process: {concurrency} streams of {args.max_tokens} tokens{waves}")
        run = run_inprocess(model_dir, work, config)
        local[concurrency] = asyncio.run(asyncio.wait_for(run, args.timeout))
        check_tokens(local[concurrency], work)
        progress(f"in-process: {local[concurrency].tokens_per_second:,.1f} output tokens/s")
        gc.collect()  # the engine's weights and KV cache go before the next ones load
    log_dir = args.logs or scratch / "logs"
    progress(f"starting the stack (logs in {log_dir})")
    stack: dict[int, SideResult] = {}
    with running_stack(scratch, model_dir, args, log_dir) as running:
        progress(f"the stack idle for {IDLE_SECONDS:.0f} s")
        idle = idle_cpu(IDLE_SECONDS)
        for concurrency, work in works.items():
            progress(f"stack: {concurrency} streams of {args.max_tokens} tokens{waves}")
            run_side = run_stack(running.gateway, running.api_key, work)
            stack[concurrency] = asyncio.run(asyncio.wait_for(run_side, args.timeout))
            check_tokens(stack[concurrency], work)
            progress(f"stack: {stack[concurrency].tokens_per_second:,.1f} output tokens/s")
    reports = {
        concurrency: report(model_name(args.model), work, local[concurrency], stack[concurrency],
                            config, idle)
        for concurrency, work in works.items()
    }  # fmt: skip
    if len(reports) == 1:
        return reports[args.concurrency]
    return {
        "model": model_name(args.model),
        "concurrency": list(reports),
        **{f"throughput_ratio_at_{c}": r["throughput_ratio"] for c, r in reports.items()},
        **{f"added_ttft_p50_ms_at_{c}": r["added_ttft_p50_ms"] for c, r in reports.items()},
        **{
            f"service_cpu_ms_per_run_at_{c}": r["service_cpu_ms_per_run"]
            for c, r in reports.items()
        },
        "idle_cpu_percent_of_a_core": reports[args.concurrency]["idle_cpu_percent_of_a_core"],
        "by_concurrency": reports,
    }


def idle_cpu(seconds: float) -> CpuWindow:
    """What the stack's processes spend while nothing is asked of them."""
    with CpuWindow() as window:
        time.sleep(seconds)
    return window


def bench_fronts(args: argparse.Namespace, scratch: Path, model_dir: Path) -> dict[str, Any]:
    """The same stack through gRPC and through HTTP (`bench.stack_http`)."""
    tokenizer = Tokenizer.from_model_dir(model_dir)
    # Each front gets rounds of its own, so neither is served from the other's prefix cache.
    work = make_stack_workload(
        tokenizer, args.concurrency, args.prompt_words, args.max_tokens, args.seed, 2 * args.rounds
    )
    ttft = make_stack_workload(tokenizer, 1, args.prompt_words, 1, args.seed + 1, args.ttft_samples)
    log_dir = args.logs or scratch / "logs"
    progress(f"starting the stack (logs in {log_dir})")
    with running_stack(scratch, model_dir, args, log_dir) as running:
        fronts = run_fronts(running.gateway, running.http, running.api_key, work, ttft.prompts)
        grpc, http, grpc_ttft, http_ttft = asyncio.run(asyncio.wait_for(fronts, args.timeout))
    for side in (grpc, http):
        check_tokens(side, work)
    return report_fronts(work, grpc, http, grpc_ttft, http_ttft)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_option(parser, synthetic=SYNTHETIC)
    parser.add_argument(
        "--concurrency",
        type=counts,
        help="concurrent streams, or several such as 1,16,64 (default 16; 8 quick)",
    )
    parser.add_argument("--max-tokens", type=int, help="output tokens each (default 64; 32 quick)")
    parser.add_argument("--prompt-words", type=int, default=40, help="words per prompt")
    parser.add_argument("--quick", action="store_true", help="a smaller workload")
    parser.add_argument("--kv-blocks", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-batched-tokens", type=int, default=512)
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="waves of --concurrency requests, one after another (more samples of TTFT)",
    )
    parser.add_argument(
        "--front",
        choices=("grpc", "http"),
        default="grpc",
        help="grpc (default): the stack through gRPC against the engine in-process; http: the"
        " stack through its HTTP API against the same stack through gRPC",
    )
    parser.add_argument(
        "--telemetry",
        action="store_true",
        help="the stack with metrics and OTLP tracing on against the same stack with both off"
        " (bench.stack_telemetry), instead of against the engine in-process",
    )
    parser.add_argument(
        "--ttft-samples",
        type=int,
        default=40,
        help="--front http: requests at one stream, the fronts alternating (default 40)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per side, all rounds")
    parser.add_argument("--logs", type=Path, help="keep the services' logs in this directory")
    args = parser.parse_args()
    args.concurrencies = args.concurrency or [8 if args.quick else 16]
    if len(args.concurrencies) > 1 and (args.front == "http" or args.telemetry):
        parser.error("--front http and --telemetry take one --concurrency")
    if min(args.concurrencies) < 1:
        parser.error("--concurrency must be at least 1")
    args.concurrency = args.concurrencies[0]
    args.max_tokens = args.max_tokens or (32 if args.quick else 64)
    for name in ("max_tokens", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main() -> int:
    return run_stack_bench(bench, parse_args(), "stack")


if __name__ == "__main__":
    sys.exit(main())
