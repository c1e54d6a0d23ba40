"""The two sides `bench.stack` compares: a workload's requests sent to `ProcessEngine`
in this process, and the same requests streamed through the four services."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import secrets
import signal
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from bench.cpu import CpuWindow, combined
from bench.report import logs_to_stderr, percentile, progress
from engine.config import EngineConfig
from engine.process_engine import ProcessEngine
from engine.sampling import SamplingParams
from engine.tokenizer import Tokenizer
from services.core.db import libpq_url
from services.stack.infra import LocalInfra
from services.stack.launcher import Services, StackConfig
from tollgate import AdminClient, AsyncClient

MODEL_NAME = "bench"
WARMUP_TOKENS = 4
WARMUP_ATTEMPTS = 10
WARM_TTFT_S = 0.5
_WORDS = (
    "the gate toll token model run tenant cache block stream queue ledger worker "
    "scheduler admission prefill decode batch lease epoch event billed kafka"
).split()


@dataclass(frozen=True, slots=True)
class StackWorkload:
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


def workload_summary(work: StackWorkload) -> dict[str, Any]:
    """The workload's figures every stack report begins with."""
    return {
        "concurrency": work.concurrency,
        "rounds": len(work.waves()),
        "max_tokens": work.max_tokens,
        "prompt_tokens_mean": round(sum(map(len, work.prompt_ids)) / len(work.prompt_ids), 1),
        "output_tokens": work.output_tokens,
    }


def make_stack_workload(
    tokenizer: Tokenizer, requests: int, words: int, max_tokens: int, seed: int, rounds: int = 1
) -> StackWorkload:
    """Seeded prompts, tokenized as admission tokenizes a plain prompt.

    Every request has a prompt of its own, so no round is served from the prefix
    cache of an earlier one.
    """
    rng = random.Random(seed)
    prompts = [
        f"request {i}: " + " ".join(rng.choice(_WORDS) for _ in range(words))
        for i in range(requests * rounds)
    ]
    return StackWorkload(prompts, [tokenizer.encode(p) for p in prompts], max_tokens, requests)


@dataclass(slots=True)
class RequestTiming:
    submitted: float
    queued: float = 0.0  # when the client read the run's queued event
    prefill: float = 0.0  # and its prefill event: a worker took it
    # The seconds between those two events' own times (the services' clock): the part of
    # queued -> prefill spent before the prefill event was stored.
    stored_queue_wait: float = 0.0
    first_token: float = 0.0
    finished: float = 0.0
    billed: float = 0.0
    token_ids: list[int] = field(default_factory=list)  # where the front tells them
    num_tokens: int = 0

    @property
    def ttft_ms(self) -> float:
        return (self.first_token - self.submitted) * 1000


@dataclass(frozen=True, slots=True)
class SideResult:
    name: str
    rounds: list[list[RequestTiming]]
    cpu: CpuWindow
    # Events the stack stored per run (0: not counted, as for a side without a store).
    events_per_run: float = 0.0

    @property
    def timings(self) -> list[RequestTiming]:
        return [timing for wave in self.rounds for timing in wave]

    @property
    def output_tokens(self) -> int:
        return sum(t.num_tokens for t in self.timings)

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


Requester = Callable[[int], Awaitable[RequestTiming]]


async def run_waves(name: str, work: StackWorkload, request: Requester) -> SideResult:
    """The workload's rounds one after another, each its requests (`request(index)`) at
    once; the CPU every process spent over them."""
    [side] = await take_turns(work, {name: request})
    return side


async def take_turns(work: StackWorkload, sides: Mapping[str, Requester]) -> list[SideResult]:
    """`run_waves` on several sides, which take turns round by round (each round's
    prompts on every side, which goes first turning each round), so that drift of the
    machine falls on all; each side's CPU is summed over its own rounds."""
    names = list(sides)
    rounds: dict[str, list[list[RequestTiming]]] = {name: [] for name in names}
    windows: dict[str, list[CpuWindow]] = {name: [] for name in names}
    for n, wave in enumerate(work.waves()):
        first = n % len(names)
        for name in names[first:] + names[:first]:
            with CpuWindow() as cpu:
                rounds[name].append(list(await asyncio.gather(*map(sides[name], wave))))
            windows[name].append(cpu)
    return [SideResult(name, rounds[name], combined(windows[name])) for name in names]


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
        timing.num_tokens = len(timing.token_ids)
        if output.finished:
            timing.finished = timing.billed = time.perf_counter()
    return timing


async def run_inprocess(model_dir: Path, work: StackWorkload, config: EngineConfig) -> SideResult:
    engine = await ProcessEngine.start(model_dir, config)
    try:
        await inprocess_request(engine, "warmup", work.prompt_ids[0][:8], WARMUP_TOKENS)
        return await run_waves(
            "in-process",
            work,
            lambda i: inprocess_request(engine, f"req-{i}", work.prompt_ids[i], work.max_tokens),
        )
    finally:
        await engine.shutdown()


async def stack_request(client: AsyncClient, prompt: str, max_tokens: int) -> RequestTiming:
    timing = RequestTiming(time.perf_counter())
    stream = client.generate(
        prompt, model=MODEL_NAME, max_tokens=max_tokens, temperature=0, ignore_eos=True
    )
    async with stream:
        queued_at = None
        async for event in stream:
            if event.kind == "queued":
                timing.queued = time.perf_counter()
                queued_at = event.time
            elif event.kind == "prefill":
                timing.prefill = time.perf_counter()
                if queued_at is not None and event.time is not None:
                    timing.stored_queue_wait = (event.time - queued_at).total_seconds()
            elif event.kind == "streaming" and event.token_ids and not timing.token_ids:
                timing.first_token = time.perf_counter()
            timing.token_ids.extend(event.token_ids if event.kind == "streaming" else ())
            timing.num_tokens = len(timing.token_ids)
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


async def run_stack(gateway: str, api_key: str, work: StackWorkload) -> SideResult:
    async with AsyncClient(gateway, api_key) as client:
        await warm_up(client, work.prompts[0][:24])
        return await run_waves(
            "stack", work, lambda i: stack_request(client, work.prompts[i], work.max_tokens)
        )


def tenant_key(admission: str, admin_token: str, unlimited: bool = False) -> str:
    """A new tenant's key; `unlimited`: without the default limits on its concurrent runs
    and streams (64 each), for workloads of more streams than that."""
    with AdminClient(admission, admin_token) as admin:
        tenant = admin.create_tenant(f"bench-stack-{uuid.uuid4().hex[:8]}")
        if unlimited:
            admin.set_quota(tenant.tenant_id, max_concurrent_runs=0, max_concurrent_streams=0)
        return admin.create_api_key(tenant.tenant_id).secret


@dataclass(frozen=True, slots=True)
class RunningStack:
    gateway: str
    http: str
    api_key: str
    admin_token: str
    database_url: str

    def stored_counts(self) -> tuple[int, int]:
        """How many events and runs the stack's database holds (all of them billed once
        a workload's runs are)."""
        with psycopg.connect(libpq_url(self.database_url)) as conn:
            row = conn.execute(
                "SELECT (SELECT count(*) FROM run_events), (SELECT count(*) FROM runs)"
            ).fetchone()
        assert row is not None
        return int(row[0]), int(row[1])


def events_per_run(before: tuple[int, int], after: tuple[int, int]) -> float:
    """Stored events per run of the runs added between two `stored_counts`."""
    runs = after[1] - before[1]
    return round((after[0] - before[0]) / runs, 2) if runs else 0.0


@contextmanager
def running_stack(
    scratch: Path,
    model_dir: Path,
    args: argparse.Namespace,
    log_dir: Path,
    extra_env: Mapping[str, str] | None = None,
    engine_env: Mapping[str, str] | None = None,
) -> Iterator[RunningStack]:
    """Infra and the four services (with `extra_env` in their environment, and
    `engine_env` in the worker's: which engine it drives); yields their addresses and a
    tenant's key.

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
                **(extra_env or {}),
            },
            engine_env=engine_env or {},
        )
        services = Services(config, log_dir)
        try:
            processes = services.start()
            admission = processes["admission"]
            key = tenant_key(admission.address, admin_token)
            yield RunningStack(
                admission.address,
                admission.endpoints["http"],
                key,
                admin_token,
                endpoints.database_url,
            )
        except Exception:
            for process in services.processes.values():
                progress(f"--- {process.name} log tail ---\n{process.log_tail()}")
            raise
        finally:
            progress("stopping the stack")
            services.stop()


def run_stack_bench(
    bench: Callable[[argparse.Namespace, Path], dict[str, Any]],
    args: argparse.Namespace,
    name: str,
) -> int:
    """`main` of a benchmark that starts a stack: `bench` in a scratch directory, its
    figures printed as the last line; the stack and the infra are stopped whatever ends
    it, Ctrl-C and SIGTERM included. Returns the exit status."""
    logs_to_stderr()
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        with tempfile.TemporaryDirectory(prefix=f"tollgate-bench-{name}-") as tmp:
            figures = bench(args, Path(tmp))
    except KeyboardInterrupt:
        progress("interrupted")
        return 130
    print(json.dumps(figures))
    return 0
