"""`bench.stack --engine-kind`: the stack in front of an engine other than its built-in one.

`--engine-kind llama-server` starts one llama.cpp `llama-server` on SmolLM2-135M-Instruct's
GGUF (`--slots` the largest concurrency measured, the threads the built-in engine would
get) and the stack in front of it, whose worker drives that server
(`TOLLGATE_ENGINE_KIND=llama-server`, `TOLLGATE_ENGINE_MAX_RUNS` = slots). Each
concurrency's workload then runs on two sides, which take turns round by round with the
same prompts (so that drift of a shared machine falls on both; the stack idles while
the other side runs): llama-server alone, each request posted straight to its
`/completion` by this process (a bare asyncio client, with the body the worker itself
sends: the prompt as token ids, streamed, greedy, EOS ignored, the same max tokens), and
the whole stack, driven as `bench.stack` drives it (`tollgate.AsyncClient`, the prompts
as text). Printed per concurrency: each side's tokens/s and TTFT, the ratio and the
added TTFT.

`--engine-kind sim` runs the stack on the simulated engine (`engine/sim_engine.py`), which
gives every running request one token a step: at `--sim-step-ms` per step, a rate of R
tokens/s is R x step streams at once. For each of `--sim-rates` it runs waves of that
many streams and reports the CPU every process spent per run and per token. The
simulated engine runs inside the worker process, so the worker's figure includes its
bookkeeping, and it is reported apart from the other services'.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from bench.cpu import BENCH
from bench.models import REAL_MODEL, model_name
from bench.models import model_dir as bench_model_dir
from bench.report import progress
from bench.stack_http import sse_post
from bench.stack_report import (
    IDLE_SECONDS,
    NOT_SERVICES,
    Targets,
    check_tokens,
    idle_cpu,
    parts,
    report,
    stored_events_line,
    summary,
)
from bench.stack_sides import (
    MODEL_NAME,
    WARMUP_TOKENS,
    RequestTiming,
    SideResult,
    StackWorkload,
    events_per_run,
    greedy,
    make_stack_workload,
    run_stack,
    running_stack,
    stack_request,
    take_turns,
    tenant_key,
    warm_up,
    workload_summary,
)
from engine.dialects import LlamaServerReader, Request, llama_server_body
from engine.model_dirs.fetch import fetch_gguf
from engine.model_dirs.registry import KNOWN_MODELS, model_cache, model_index
from engine.tokenizer import Tokenizer
from services.core.config import env_int
from services.stack.launcher import (
    COLOCATED_RESERVED_CORES,
    RESERVE_FROM_CORES,
    THREAD_VARIABLES,
    physical_cores,
)
from services.worker.app import engine_threads
from tollgate import AsyncClient
from tools.llama_server import LlamaServer

LLAMA_SERVER_TARGETS = Targets(throughput=0.95, added_ttft_p50_ms=10.0)
# Without --rounds, each concurrency runs rounds enough for this many requests (TTFT
# samples): one stream runs them one after another.
REQUESTS = 32
QUICK_REQUESTS = 8
# llama-server's context per slot: the longest prompt and its output, rounded up to this.
SLOT_CONTEXT_STEP = 256
SIM_ROUNDS = 4
# KV blocks the simulated pool holds per block the largest wave's runs need.
SIM_KV_HEADROOM = 2
WORKER = "worker"


def describe(work: StackWorkload) -> str:
    rounds = len(work.waves())
    return f"{work.concurrency} streams of {work.max_tokens} tokens x {rounds} rounds"


def rounds_at(args: argparse.Namespace, concurrency: int) -> int:
    """`--rounds`, or enough rounds at `concurrency` for REQUESTS requests."""
    requests = QUICK_REQUESTS if args.quick else REQUESTS
    return args.rounds or max(1, math.ceil(requests / concurrency))


def builtin_threads() -> int:
    """The threads the stack's built-in engine would run with on this machine: as the
    launcher reserves cores and the worker counts them."""
    reserved = env_int("TOLLGATE_RESERVED_CORES", 0)
    chosen = any(name in os.environ for name in THREAD_VARIABLES)
    if not chosen and physical_cores() >= RESERVE_FROM_CORES:
        reserved = int(COLOCATED_RESERVED_CORES)
    configured = engine_threads(env_int("TOLLGATE_ENGINE_THREADS", 0), reserved)
    return configured or torch.get_num_threads()


async def llama_server_request(url: str, prompt_ids: list[int], max_tokens: int) -> RequestTiming:
    """One request straight to llama-server, with the body the worker sends for a run."""
    timing = RequestTiming(time.perf_counter())
    body = llama_server_body(Request(prompt_ids, greedy(max_tokens), MODEL_NAME))
    reader = LlamaServerReader()
    async for data in sse_post(url, "/completion", body):
        delta = reader.read(json.loads(data))
        if delta.token_ids and not timing.token_ids:
            timing.first_token = time.perf_counter()
        timing.token_ids.extend(delta.token_ids)
        if delta.finish_reason is not None:
            timing.finished = timing.billed = time.perf_counter()
    timing.num_tokens = len(timing.token_ids)
    if not timing.finished:
        raise RuntimeError("llama-server's stream ended before its last chunk")
    return timing


async def run_both(
    url: str, gateway: str, api_key: str, work: StackWorkload
) -> tuple[SideResult, SideResult]:
    """The workload on llama-server alone and through the stack, round by round in turn."""
    # A whole prompt: llama-server's first one of a length takes it far longer than the next.
    await llama_server_request(url, work.prompt_ids[0], WARMUP_TOKENS)
    async with AsyncClient(gateway, api_key) as client:
        await warm_up(client, work.prompts[0][:24])
        alone, stack = await take_turns(
            work,
            {
                "llama-server": lambda i: llama_server_request(
                    url, work.prompt_ids[i], work.max_tokens
                ),
                "stack": lambda i: stack_request(client, work.prompts[i], work.max_tokens),
            },
        )
    return alone, stack


def bench_llama_server(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    model_dir = bench_model_dir(REAL_MODEL, scratch)
    gguf = fetch_gguf(KNOWN_MODELS[REAL_MODEL], model_cache(), index=model_index())
    tokenizer = Tokenizer.from_model_dir(model_dir)
    works = {
        c: make_stack_workload(
            tokenizer, c, args.prompt_words, args.max_tokens, args.seed, rounds_at(args, c)
        )
        for c in args.concurrencies
    }
    slots = max(args.concurrencies)
    longest = max(len(p) for work in works.values() for p in work.prompt_ids)
    per_slot = SLOT_CONTEXT_STEP * math.ceil((longest + args.max_tokens) / SLOT_CONTEXT_STEP)
    threads = builtin_threads()
    log_dir = args.logs or scratch / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    progress(f"starting llama-server: {gguf.name}, {slots} slots, {threads} threads")
    log = log_dir / "llama-server.log"
    sides: dict[int, tuple[SideResult, SideResult]] = {}
    with LlamaServer(
        gguf, slots=slots, context=slots * per_slot, threads=threads, log=log
    ) as server:
        engine_env = {
            "TOLLGATE_ENGINE_KIND": "llama-server",
            "TOLLGATE_ENGINE_URL": server.url,
            "TOLLGATE_ENGINE_MAX_RUNS": str(slots),
        }
        progress(f"starting the stack in front of it (logs in {log_dir})")
        with running_stack(scratch, model_dir, args, log_dir, engine_env=engine_env) as running:
            progress(f"the stack idle for {IDLE_SECONDS:.0f} s")
            idle = idle_cpu()
            for c, work in works.items():
                progress(f"llama-server alone and the stack in turn: {describe(work)} each")
                run = run_both(server.url, running.gateway, running.api_key, work)
                sides[c] = asyncio.run(asyncio.wait_for(run, 2 * args.timeout))
                for side in sides[c]:
                    check_tokens(side, work)
                    progress(f"{side.name}: {side.tokens_per_second:,.1f} output tokens/s")
    settings = {
        "engine_kind": "llama-server",
        "gguf": gguf.name,
        "slots": slots,
        "threads": threads,
    }
    targets, key = LLAMA_SERVER_TARGETS, "llama_server"
    reports = {
        c: report(REAL_MODEL, work, *sides[c], idle, targets, key, settings)
        for c, work in works.items()
    }
    print(
        f"{'streams':>8}{'llama tok/s':>13}{'stack tok/s':>13}{'ratio':>8}"
        f"{'llama ttft p50':>16}{'stack ttft p50':>16}{'added':>9}"
    )
    for c, figures in reports.items():
        print(
            f"{c:>8}{figures['llama_server_tokens_per_s']:>13.1f}"
            f"{figures['stack_tokens_per_s']:>13.1f}{figures['throughput_ratio']:>8.3f}"
            f"{figures['llama_server_ttft_p50_ms']:>16.1f}{figures['stack_ttft_p50_ms']:>16.1f}"
            f"{figures['added_ttft_p50_ms']:>9.1f}"
        )
    print(
        f"targets: ratio >= {LLAMA_SERVER_TARGETS.throughput}, added TTFT p50 <= "
        f"{LLAMA_SERVER_TARGETS.added_ttft_p50_ms:.0f} ms at one stream"
    )
    return {**summary(REAL_MODEL, reports), **settings}


def sim_streams(rate: int, step_ms: float) -> int:
    """Streams at once for `rate` tokens/s when each gets one token every `step_ms`."""
    return max(1, round(rate * step_ms / 1000))


def sim_kv_blocks(works: list[StackWorkload], block_size: int, least: int) -> int:
    """A simulated KV pool that holds SIM_KV_HEADROOM times the largest wave's runs."""
    need = max(
        sum(math.ceil((len(work.prompt_ids[i]) + work.max_tokens) / block_size) for i in wave)
        for work in works
        for wave in work.waves()
    )
    return max(least, SIM_KV_HEADROOM * need)


def bench_sim(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    model_dir = bench_model_dir(args.model, scratch)
    tokenizer = Tokenizer.from_model_dir(model_dir)
    rounds = args.rounds or (1 if args.quick else SIM_ROUNDS)
    works = {
        rate: make_stack_workload(
            tokenizer,
            sim_streams(rate, args.sim_step_ms),
            args.prompt_words,
            args.max_tokens,
            args.seed,
            rounds,
        )
        for rate in args.sim_rates
    }
    max_runs = max(work.concurrency for work in works.values())
    kv_blocks = sim_kv_blocks(list(works.values()), args.block_size, args.kv_blocks)
    engine_env = {
        "TOLLGATE_ENGINE_KIND": "sim",
        "TOLLGATE_SIM_STEP_MS": str(args.sim_step_ms),
        "TOLLGATE_ENGINE_MAX_RUNS": str(max_runs),
        "TOLLGATE_KV_BLOCKS": str(kv_blocks),
    }
    log_dir = args.logs or scratch / "logs"
    progress(f"starting the stack on the simulated engine: {engine_env} (logs in {log_dir})")
    sides: dict[int, SideResult] = {}
    with running_stack(scratch, model_dir, args, log_dir, engine_env=engine_env) as running:
        # More streams than a tenant's default limits (64 runs, 64 streams) let in.
        api_key = tenant_key(running.gateway, running.admin_token, unlimited=True)
        progress(f"the stack idle for {IDLE_SECONDS:.0f} s")
        idle = idle_cpu()
        for rate, work in works.items():
            progress(f"sim {rate} tokens/s: {describe(work)}")
            run = run_stack(running.gateway, api_key, work)
            before = running.stored_counts()
            side = asyncio.run(asyncio.wait_for(run, args.timeout))
            stored = events_per_run(before, running.stored_counts())
            sides[rate] = dataclasses.replace(side, events_per_run=stored)
            check_tokens(sides[rate], work)
            progress(f"sim {rate}: {sides[rate].tokens_per_second:,.1f} output tokens/s")
    figures = {rate: sim_figures(rate, works[rate], side) for rate, side in sides.items()}
    report_sim(figures, sides)
    idle_percent = idle.percent_of_a_core(exclude=NOT_SERVICES)
    print(
        f"idle: {sum(idle_percent.values()):.1f}% of a core ({parts(idle_percent, '%')}); the"
        " worker's CPU includes the simulated engine's bookkeeping (it runs in the worker"
        " process; there is no engine process)"
    )
    return {
        "engine_kind": "sim",
        "model": model_name(args.model),
        "sim_step_ms": args.sim_step_ms,
        "sim_kv_blocks": kv_blocks,
        "sim_max_runs": max_runs,
        "idle_cpu_percent_of_a_core": round(sum(idle_percent.values()), 2),
        "idle_cpu_percent_by_role": idle_percent,
        "by_rate": figures,
    }


def sim_figures(rate: int, work: StackWorkload, side: SideResult) -> dict[str, Any]:
    runs, tokens = len(side.timings), side.output_tokens
    per_run = side.cpu.ms_per_run(runs, exclude=NOT_SERVICES)
    worker = per_run.pop(WORKER, 0.0)
    services = sum(per_run.values())
    return {
        "rate": rate,
        **workload_summary(work),
        "tokens_per_s": round(side.tokens_per_second, 1),
        "ttft_p50_ms": round(side.ttft_ms(50), 2),
        "ttft_p99_ms": round(side.ttft_ms(99), 2),
        "billed_p50_ms": round(side.billed_ms(50), 2),
        "stored_events_per_run": side.events_per_run,
        "worker_cpu_ms_per_run": round(worker, 2),
        "worker_cpu_us_per_token": round(1000 * worker * runs / tokens, 1),
        "other_services_cpu_ms_per_run": round(services, 2),
        "other_services_cpu_us_per_token": round(1000 * services * runs / tokens, 1),
        "other_services_cpu_ms_per_run_by_role": per_run,
        "bench_cpu_s": round(side.cpu.seconds.get(BENCH, 0.0), 2),
        "cpu_s": side.cpu.rounded(),
        "cpu_busy": round(side.cpu.busy_fraction, 3),
        "num_cores": side.cpu.num_cores,
    }


def report_sim(figures: dict[int, dict[str, Any]], sides: dict[int, SideResult]) -> None:
    print(
        f"{'sim rate':>9}{'streams':>8}{'tok/s':>9}{'ttft p50':>10}{'worker ms/run':>15}"
        f"{'µs/token':>10}{'others ms/run':>15}{'µs/token':>10}{'busy':>7}"
    )
    for rate, f in figures.items():
        print(
            f"{rate:>9}{f['concurrency']:>8}{f['tokens_per_s']:>9.1f}{f['ttft_p50_ms']:>10.1f}"
            f"{f['worker_cpu_ms_per_run']:>15.2f}{f['worker_cpu_us_per_token']:>10.1f}"
            f"{f['other_services_cpu_ms_per_run']:>15.2f}"
            f"{f['other_services_cpu_us_per_token']:>10.1f}{f['cpu_busy']:>7.0%}"
        )
    for rate, f in figures.items():
        others = parts(f["other_services_cpu_ms_per_run_by_role"], "ms")
        print(f"sim {rate}: the other services' CPU per run: {others}")
        print(f"sim {rate}: {stored_events_line(f['stored_events_per_run'], f['max_tokens'])}")
        print(f"CPU seconds, sim {rate}: {sides[rate].cpu.describe()}")
