"""The whole stack against the same engine in-process: throughput and added TTFT.

    python -m bench.stack [--concurrency N] [--max-tokens M] [--rounds R] [--quick]

Generates a small random Llama, then runs one workload twice: N concurrent
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
import json
import random
import secrets
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from bench.cpu import CpuWindow
from engine.config import EngineConfig
from engine.process_engine import ProcessEngine
from engine.sampling import SamplingParams
from engine.tiny import init_tiny_model
from engine.tokenizer import Tokenizer
from services.core.infra import LocalInfra
from services.stack.launcher import Services, StackConfig
from tollgate import AdminClient, AsyncClient

# Big enough that engine steps, not Python overhead, dominate the in-process run.
MODEL_SHAPE: dict[str, Any] = {"layers": 4, "hidden": 256, "heads": 8, "kv_heads": 4, "vocab": 512}
MODEL_NAME = "bench"
WARMUP_TOKENS = 4
THROUGHPUT_TARGET = 0.85
ADDED_TTFT_P50_TARGET_MS = 15.0
_WORDS = (
    "the gate toll token model run tenant cache block stream queue ledger worker "
    "scheduler admission prefill decode batch lease epoch event billed kafka"
).split()


@dataclass(frozen=True, slots=True)
class Workload:
    """`rounds` waves of `concurrency` requests, each wave with prompts of its own."""

    prompts: list[str]
    prompt_ids: list[list[int]]
    max_tokens: int
    concurrency: int

    @property
    def output_tokens(self) -> int:
        return len(self.prompts) * self.max_tokens

    def waves(self) -> list[range]:
        """The request indexes of each round, in order."""
        return [
            range(start, start + self.concurrency)
            for start in range(0, len(self.prompts), self.concurrency)
        ]


@dataclass(slots=True)
class RequestTiming:
    submitted: float
    first_token: float = 0.0
    finished: float = 0.0
    billed: float = 0.0
    token_ids: list[int] = field(default_factory=list)

    @property
    def ttft_ms(self) -> float:
        return (self.first_token - self.submitted) * 1000


@dataclass(frozen=True, slots=True)
class SideResult:
    name: str
    rounds: list[list[RequestTiming]]
    cpu: CpuWindow

    @property
    def timings(self) -> list[RequestTiming]:
        return [timing for wave in self.rounds for timing in wave]

    @property
    def output_tokens(self) -> int:
        return sum(len(t.token_ids) for t in self.timings)

    @property
    def seconds(self) -> float:
        """Each round from its first submit to its last request finishing, summed."""
        return sum(
            max(t.finished for t in wave) - min(t.submitted for t in wave) for wave in self.rounds
        )

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds

    def ttft_ms(self, q: float) -> float:
        return percentile([t.ttft_ms for t in self.timings], q)

    def billed_ms(self, q: float) -> float:
        return percentile([(t.billed - t.submitted) * 1000 for t in self.timings], q)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def make_workload(
    tokenizer: Tokenizer, requests: int, words: int, max_tokens: int, seed: int, rounds: int = 1
) -> Workload:
    """Seeded prompts, tokenized as admission tokenizes a plain prompt.

    Every request has a prompt of its own, so no round is served from the prefix
    cache of an earlier one.
    """
    rng = random.Random(seed)
    prompts = [
        f"request {i}: " + " ".join(rng.choice(_WORDS) for _ in range(words))
        for i in range(requests * rounds)
    ]
    return Workload(prompts, [tokenizer.encode(p) for p in prompts], max_tokens, requests)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        block_size=args.block_size,
        num_kv_blocks=args.kv_blocks,
        max_num_batched_tokens=args.max_batched_tokens,
    )


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


async def inprocess_request(
    engine: ProcessEngine, request_id: str, prompt_ids: list[int], max_tokens: int
) -> RequestTiming:
    timing = RequestTiming(time.perf_counter())
    stream = engine.add_request(
        request_id, prompt_ids, greedy(max_tokens), cache_namespace=MODEL_NAME
    )
    async for output in stream:
        if output.new_token_ids and not timing.token_ids:
            timing.first_token = time.perf_counter()
        timing.token_ids.extend(output.new_token_ids)
        if output.finished:
            timing.finished = timing.billed = time.perf_counter()
    return timing


async def run_inprocess(model_dir: Path, work: Workload, config: EngineConfig) -> SideResult:
    engine = await ProcessEngine.start(model_dir, config)
    try:
        await inprocess_request(engine, "warmup", work.prompt_ids[0][:8], WARMUP_TOKENS)
        with CpuWindow() as cpu:
            rounds = [
                list(
                    await asyncio.gather(
                        *(
                            inprocess_request(
                                engine, f"req-{i}", work.prompt_ids[i], work.max_tokens
                            )
                            for i in wave
                        )
                    )
                )
                for wave in work.waves()
            ]
    finally:
        await engine.shutdown()
    return SideResult("in-process", rounds, cpu)


async def stack_request(client: AsyncClient, prompt: str, max_tokens: int) -> RequestTiming:
    timing = RequestTiming(time.perf_counter())
    stream = client.generate(
        prompt, model=MODEL_NAME, max_tokens=max_tokens, temperature=0, ignore_eos=True
    )
    async with stream:
        async for event in stream:
            if event.kind == "streaming" and event.token_ids and not timing.token_ids:
                timing.first_token = time.perf_counter()
            timing.token_ids.extend(event.token_ids if event.kind == "streaming" else ())
            if event.kind == "completed":
                timing.finished = time.perf_counter()
            elif event.kind == "billed":
                timing.billed = time.perf_counter()
            elif event.kind in ("failed", "cancelled"):
                raise RuntimeError(f"run {event.run_id} ended {event.kind}: {event!r}")
    if not timing.billed:
        raise RuntimeError(f"run {stream.run_id} stream ended at state {stream.state}")
    return timing


async def warm_up(client: AsyncClient, prompt: str) -> None:
    """Runs small requests until the stack is steady.

    Right after start-up the scheduler's Kafka consumer is still joining its group,
    so new runs wait for the scheduler's periodic rescan instead of the Kafka
    trigger; that is start-up cost, not the steady state this bench measures.
    """
    for attempt in range(WARMUP_ATTEMPTS):
        timing = await stack_request(client, prompt, WARMUP_TOKENS)
        ttft = timing.first_token - timing.submitted if timing.first_token else float("inf")
        progress(f"warm-up {attempt + 1}: TTFT {ttft * 1000:.0f} ms")
        if ttft < WARM_TTFT_S:
            return
        await asyncio.sleep(1.0)


async def run_stack(gateway: str, api_key: str, work: Workload) -> SideResult:
    async with AsyncClient(gateway, api_key) as client:
        await warm_up(client, work.prompts[0][:24])
        with CpuWindow() as cpu:
            rounds = [
                list(
                    await asyncio.gather(
                        *(stack_request(client, work.prompts[i], work.max_tokens) for i in wave)
                    )
                )
                for wave in work.waves()
            ]
    return SideResult("stack", rounds, cpu)


WARMUP_ATTEMPTS = 10
WARM_TTFT_S = 0.5


def tenant_key(admission: str, admin_token: str) -> str:
    with AdminClient(admission, admin_token) as admin:
        tenant = admin.create_tenant(f"bench-stack-{uuid.uuid4().hex[:8]}")
        return admin.create_api_key(tenant.tenant_id).secret


@contextmanager
def running_stack(
    scratch: Path, model_dir: Path, args: argparse.Namespace, log_dir: Path
) -> Iterator[tuple[str, str]]:
    """Infra and the four services; yields the gateway address and a tenant's key.

    Everything started here is stopped on the way out, whatever ends the run.
    """
    topic = f"bench-stack-{uuid.uuid4().hex[:8]}"
    admin_token = secrets.token_urlsafe(24)
    with LocalInfra(scratch / "infra", topics=[topic]) as endpoints:
        config = StackConfig(
            database_url=endpoints.database_url,
            kafka_bootstrap=endpoints.kafka_bootstrap,
            model_name=MODEL_NAME,
            model_dir=model_dir,
            admin_token=admin_token,
            topic=topic,
            num_kv_blocks=args.kv_blocks,
            extra_env={
                "TOLLGATE_BLOCK_SIZE": str(args.block_size),
                "TOLLGATE_MAX_BATCHED_TOKENS": str(args.max_batched_tokens),
            },
        )
        services = Services(config, log_dir)
        try:
            processes = services.start()
            gateway = processes["admission"].address
            yield gateway, tenant_key(gateway, admin_token)
        except Exception:
            for process in services.processes.values():
                progress(f"--- {process.name} log tail ---\n{process.log_tail()}")
            raise
        finally:
            progress("stopping the stack")
            services.stop()


def report(
    work: Workload, local: SideResult, stack: SideResult, config: EngineConfig
) -> dict[str, Any]:
    header = f"{'side':<12}{'tokens':>8}{'seconds':>9}{'tok/s':>9}{'ttft p50':>10}{'ttft p99':>10}"
    print(f"{header}{'billed p50':>12}{'billed p99':>12}")
    for side in (local, stack):
        billed = (
            f"{side.billed_ms(0.5):>12.1f}{side.billed_ms(0.99):>12.1f}"
            if side is stack
            else f"{'-':>12}{'-':>12}"
        )
        print(
            f"{side.name:<12}{side.output_tokens:>8}{side.seconds:>9.2f}"
            f"{side.tokens_per_second:>9.1f}{side.ttft_ms(0.5):>10.1f}{side.ttft_ms(0.99):>10.1f}"
            + billed
        )
    ratio = stack.tokens_per_second / local.tokens_per_second
    added_p50 = stack.ttft_ms(0.5) - local.ttft_ms(0.5)
    added_p99 = stack.ttft_ms(0.99) - local.ttft_ms(0.99)
    print(
        f"stack/in-process throughput {ratio:.3f} (target >= {THROUGHPUT_TARGET}); "
        f"added TTFT p50 {added_p50:.1f} ms (target <= {ADDED_TTFT_P50_TARGET_MS:.0f}), "
        f"p99 {added_p99:.1f} ms"
    )
    for side in (local, stack):
        print(f"CPU seconds, {side.name}: {side.cpu.describe()}")
    same = sum(
        a.token_ids == b.token_ids for a, b in zip(local.timings, stack.timings, strict=True)
    )
    return {
        "concurrency": work.concurrency,
        "rounds": len(work.waves()),
        "max_tokens": work.max_tokens,
        "prompt_tokens_mean": round(sum(map(len, work.prompt_ids)) / len(work.prompt_ids), 1),
        "output_tokens": work.output_tokens,
        "num_kv_blocks": config.num_kv_blocks,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "inprocess_tokens_per_s": round(local.tokens_per_second, 1),
        "stack_tokens_per_s": round(stack.tokens_per_second, 1),
        "throughput_ratio": round(ratio, 3),
        "inprocess_ttft_p50_ms": round(local.ttft_ms(0.5), 2),
        "inprocess_ttft_p99_ms": round(local.ttft_ms(0.99), 2),
        "stack_ttft_p50_ms": round(stack.ttft_ms(0.5), 2),
        "stack_ttft_p99_ms": round(stack.ttft_ms(0.99), 2),
        "added_ttft_p50_ms": round(added_p50, 2),
        "added_ttft_p99_ms": round(added_p99, 2),
        "stack_billed_p50_ms": round(stack.billed_ms(0.5), 2),
        "stack_billed_p99_ms": round(stack.billed_ms(0.99), 2),
        "identical_outputs": same,
        "num_cores": stack.cpu.num_cores,
        "inprocess_cpu_s": local.cpu.rounded(),
        "stack_cpu_s": stack.cpu.rounded(),
        "inprocess_cpu_busy": round(local.cpu.busy_fraction, 3),
        "stack_cpu_busy": round(stack.cpu.busy_fraction, 3),
        "meets_throughput_target": ratio >= THROUGHPUT_TARGET,
        "meets_ttft_target": added_p50 <= ADDED_TTFT_P50_TARGET_MS,
    }


def check_tokens(side: SideResult, work: Workload) -> None:
    counts = {len(t.token_ids) for t in side.timings}
    if counts != {work.max_tokens}:
        raise RuntimeError(f"{side.name}: output lengths {sorted(counts)}, not {work.max_tokens}")


def bench(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    progress("generating the model")
    model_dir = init_tiny_model(scratch / "model", **MODEL_SHAPE)
    work = make_workload(
        Tokenizer.from_model_dir(model_dir),
        args.concurrency,
        args.prompt_words,
        args.max_tokens,
        args.seed,
        args.rounds,
    )
    config = engine_config(args)
    waves = f" x {args.rounds} rounds" if args.rounds > 1 else ""
    progress(f"in-process: {args.concurrency} streams of {args.max_tokens} tokens{waves}")
    local = asyncio.run(asyncio.wait_for(run_inprocess(model_dir, work, config), args.timeout))
    check_tokens(local, work)
    progress(f"in-process: {local.tokens_per_second:,.1f} output tokens/s")
    gc.collect()  # the engine's weights and KV cache go before the services load theirs
    log_dir = args.logs or scratch / "logs"
    progress(f"starting the stack (logs in {log_dir})")
    with running_stack(scratch, model_dir, args, log_dir) as (gateway, api_key):
        progress(f"stack: {args.concurrency} streams of {args.max_tokens} tokens{waves}")
        stack = asyncio.run(asyncio.wait_for(run_stack(gateway, api_key, work), args.timeout))
    check_tokens(stack, work)
    progress(f"stack: {stack.tokens_per_second:,.1f} output tokens/s")
    return report(work, local, stack, config)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, help="concurrent streams (default 16; 8 quick)")
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
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per side, all rounds")
    parser.add_argument("--logs", type=Path, help="keep the services' logs in this directory")
    args = parser.parse_args()
    args.concurrency = args.concurrency or (8 if args.quick else 16)
    args.max_tokens = args.max_tokens or (32 if args.quick else 64)
    for name in ("concurrency", "max_tokens", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main() -> int:
    args = parse_args()
    # Progress and the launcher's logs on stderr; stdout is the table and the JSON line.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    # SIGTERM takes the Ctrl-C path, so the stack and the infra are stopped either way.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        with tempfile.TemporaryDirectory(prefix="tollgate-bench-stack-") as tmp:
            figures = bench(args, Path(tmp))
    except KeyboardInterrupt:
        progress("interrupted")
        return 130
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
