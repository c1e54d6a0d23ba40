"""The whole stack against the same engine in-process: throughput and added TTFT.

    python -m bench.stack [--model NAME|56m|tiny] [--concurrency N] [--max-tokens M] [--rounds R] [--quick]
    python -m bench.stack --front http [...]   # the HTTP front door against gRPC (bench.stack_http)
    python -m bench.stack --telemetry [...]    # metrics and OTLP tracing on against off
    python -m bench.stack --engine-kind llama-server [...]  # the stack against llama-server alone
    python -m bench.stack --engine-kind sim [--sim-rates 1000,5000,20000]  # CPU per run at rates
    python -m bench.stack --anchor llama-server [--busy]  # the stack against llama-server alone

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
`--engine-kind llama-server` and `--engine-kind sim` put another engine behind the
worker (bench.stack_engines): llama.cpp's server, compared with that server alone, or
the simulated engine, at the token rates a GPU would give.
The last line is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.models import REAL_MODEL, SYNTHETIC, add_model_option, model_name
from bench.models import model_dir as bench_model_dir
from bench.report import counts, progress
from bench.stack_anchor import (
    LEVELS,
    MAX_TOKENS,
    QUICK_LEVELS,
    QUICK_MAX_TOKENS,
    bench_anchor,
)
from bench.stack_engines import bench_llama_server, bench_sim
from bench.stack_http import report_fronts, run_fronts
from bench.stack_report import IDLE_SECONDS, Targets, check_tokens, idle_cpu, report, summary
from bench.stack_sides import (
    SideResult,
    events_per_run,
    make_stack_workload,
    run_inprocess,
    run_stack,
    run_stack_bench,
    running_stack,
)
from bench.stack_telemetry import bench_telemetry
from engine.config import KV_DTYPES, EngineConfig
from engine.tokenizer import Tokenizer

THROUGHPUT_TARGET = 0.85
ADDED_TTFT_P50_TARGET_MS = 15.0
ENGINE_KINDS = ("builtin", "sim", "llama-server")
SIM_RATES = [1000, 5000, 20000]
QUICK_SIM_RATES = [1000, 5000]


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        block_size=args.block_size,
        num_kv_blocks=args.kv_blocks,
        max_num_batched_tokens=args.max_batched_tokens,
    )


def bench(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    if args.engine_kind == "llama-server":
        return bench_llama_server(args, scratch)
    if args.engine_kind == "sim":
        return bench_sim(args, scratch)
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
        idle = idle_cpu()
        for concurrency, work in works.items():
            progress(f"stack: {concurrency} streams of {args.max_tokens} tokens{waves}")
            run_side = run_stack(running.gateway, running.api_key, work)
            before = running.stored_counts()
            side = asyncio.run(asyncio.wait_for(run_side, args.timeout))
            stored = events_per_run(before, running.stored_counts())
            stack[concurrency] = dataclasses.replace(side, events_per_run=stored)
            check_tokens(stack[concurrency], work)
            progress(f"stack: {stack[concurrency].tokens_per_second:,.1f} output tokens/s")
    targets = Targets(THROUGHPUT_TARGET, ADDED_TTFT_P50_TARGET_MS)
    settings = {
        "num_kv_blocks": config.num_kv_blocks,
        "max_num_batched_tokens": config.max_num_batched_tokens,
    }
    model = model_name(args.model)
    reports = {
        concurrency: report(model, work, local[concurrency], stack[concurrency], idle, targets,
                            "inprocess", settings)
        for concurrency, work in works.items()
    }  # fmt: skip
    return summary(model, reports)


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


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_option(parser, synthetic=SYNTHETIC)
    parser.add_argument(
        "--concurrency",
        type=counts,
        help="concurrent streams, or several such as 1,16,64 (default 16, 8 quick; with"
        " --engine-kind llama-server 1,16, 1,4 quick)",
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
        help="waves of --concurrency requests, one after another (more samples of TTFT;"
        " default 1; with --engine-kind llama-server enough for 32 requests at each"
        " concurrency, 8 quick; with sim 4, 1 quick)",
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
        "--engine-kind",
        choices=ENGINE_KINDS,
        default="builtin",
        help="the worker's engine: builtin (default; against it in-process), llama-server"
        f" (against a llama-server alone, on {REAL_MODEL}'s GGUF) or sim (the simulated"
        " engine: the services' CPU at --sim-rates)",
    )
    parser.add_argument(
        "--anchor",
        choices=("llama-server",),
        help="the whole stack on its built-in engine against llama-server alone, the same"
        " HTTP client and workload on both (bench.stack_anchor)",
    )
    parser.add_argument(
        "--precision",
        choices=("int8", "fp32", "both"),
        default="both",
        help="--anchor: int8 against Q8_0, fp32 against F32, or both (default)",
    )
    parser.add_argument(
        "--requests", type=int, help="--anchor: requests at each concurrency (48; 8 quick)"
    )
    parser.add_argument(
        "--busy", action="store_true", help="--anchor: each side again with a busy loop beside"
    )
    parser.add_argument(
        "--reference", action="store_true", help="--anchor: llama-server on Q4_1 too"
    )
    parser.add_argument(
        "--kv-dtype",
        choices=KV_DTYPES,
        default="bfloat16",
        help="--anchor: the stack's KV cache (default bfloat16: llama-server's is 16-bit)",
    )
    parser.add_argument(
        "--sim-rates",
        type=counts,
        help="--engine-kind sim: output tokens/s the simulated engine gives, one run each"
        " (default 1000,5000,20000; 1000,5000 quick)",
    )
    parser.add_argument(
        "--sim-step-ms",
        type=float,
        default=20.0,
        help="--engine-kind sim: milliseconds per step, one token to every stream (default"
        " 20: a rate of R tokens/s is R/50 streams)",
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
    args = parser.parse_args(argv)
    builtin = args.engine_kind == "builtin"
    if not builtin and (args.front == "http" or args.telemetry):
        parser.error("--front http and --telemetry run the built-in engine")
    if args.engine_kind == "llama-server" and args.model not in (None, REAL_MODEL):
        parser.error(f"--engine-kind llama-server runs {REAL_MODEL} (its GGUF)")
    if args.engine_kind == "sim":
        if args.concurrency:
            parser.error("--engine-kind sim takes --sim-rates, which set the streams")
        args.sim_rates = args.sim_rates or (QUICK_SIM_RATES if args.quick else SIM_RATES)
        if min(args.sim_rates) < 1 or args.sim_step_ms <= 0:
            parser.error("--sim-rates and --sim-step-ms must be positive")
    elif args.sim_rates:
        parser.error("--sim-rates needs --engine-kind sim")
    if args.anchor:
        if not builtin or args.front == "http" or args.telemetry:
            parser.error("--anchor runs the built-in engine, over HTTP, on its own")
        if args.model not in (None, REAL_MODEL):
            parser.error(f"--anchor runs {REAL_MODEL} (its GGUF)")
        args.precisions = ("int8", "fp32") if args.precision == "both" else (args.precision,)
        default_concurrencies = list(QUICK_LEVELS if args.quick else LEVELS)
        args.max_tokens = args.max_tokens or (QUICK_MAX_TOKENS if args.quick else MAX_TOKENS)
    elif args.engine_kind == "llama-server":
        default_concurrencies = [1, 4] if args.quick else [1, 16]
    else:
        default_concurrencies = [8 if args.quick else 16]
    args.concurrencies = args.concurrency or default_concurrencies
    if len(args.concurrencies) > 1 and (args.front == "http" or args.telemetry):
        parser.error("--front http and --telemetry take one --concurrency")
    if min(args.concurrencies) < 1:
        parser.error("--concurrency must be at least 1")
    args.concurrency = args.concurrencies[0]
    args.max_tokens = args.max_tokens or (32 if args.quick else 64)
    if builtin:
        args.rounds = args.rounds or 1  # the other kinds choose theirs (bench.stack_engines)
    for name in ("max_tokens", "rounds"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main() -> int:
    args = parse_args()
    if args.anchor:
        return run_stack_bench(bench_anchor, args, "anchor")
    return run_stack_bench(bench, args, "stack")


if __name__ == "__main__":
    sys.exit(main())
