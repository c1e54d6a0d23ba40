"""`python -m bench.engine --adapters 0,1,4`: throughput with LoRA adapters in the batch.

One run, the random workload of `bench.engine` (all requests at once, greedy, EOS
ignored): the base model alone; for each N > 0, N random rank-8 adapters on every
projection (`tollgate models adapter-init`) loaded beside it, the requests spread over
them round-robin; and one adapter merged into the weights (what a worker serving a single
adapter would run if it merged). Throughput is output tokens per second; each is also
given as a fraction of the base model's. Table on stdout, progress on stderr, and the
last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench.engine import Mix, serve
from bench.models import model_dir as bench_model_dir
from bench.models import model_name
from bench.report import progress
from bench.workload import Workload, make_workload
from engine.adapters import load_adapter, merge_adapter
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader import load_model, load_model_config, load_tokenizer
from engine.model_dirs.adapter_init import init_adapter
from engine.sampling import SamplingParams

RANK = 8
MERGED = "1 adapter, merged"


def main(args: argparse.Namespace, mix: Mix) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        model_dir = bench_model_dir(args.model, root)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        work = make_workload(
            "random", mix.num_requests, vocab, args.seed, mix.prompt_lens, mix.output_lens
        )
        dirs = [
            init_adapter(root / f"adapter-{i}", model_dir, rank=RANK, seed=i)
            for i in range(max(args.adapters, default=0) or 1)
        ]
        config = EngineConfig(max_num_batched_tokens=args.max_batched_tokens)
        rates: dict[str, float] = {}
        for count in sorted(set([0, *args.adapters])):
            progress(f"engine with {count} adapter(s)")
            rates[_label(count)] = _rate(_unmerged(model_dir, dirs[:count], config), work, count)
        progress("engine with one adapter merged")
        rates[MERGED] = _rate(_merged(model_dir, dirs[0], config), work, 0)
    base = rates[_label(0)]
    print(f"{'engine':<28} {'tok/s':>8} {'vs base':>8}")
    for name, rate in rates.items():
        print(f"{name:<28} {rate:>8.1f} {rate / base:>8.2f}")
    figures = {
        "model": model_name(args.model),
        "quick": args.quick,
        "threads": torch.get_num_threads(),
        "requests": mix.num_requests,
        "output_tokens": work.num_output_tokens,
        "rank": RANK,
        "output_tokens_per_s": {name: round(rate, 1) for name, rate in rates.items()},
        "vs_base": {name: round(rate / base, 3) for name, rate in rates.items()},
    }
    print(json.dumps(figures))


def _label(count: int) -> str:
    return "base alone" if count == 0 else f"{count} adapter(s) in the batch"


def _unmerged(model_dir: Path, dirs: list[Path], config: EngineConfig) -> LLMEngine:
    adapters = tuple((f"adapter-{i}", str(d)) for i, d in enumerate(dirs))
    return LLMEngine.from_model_dir(model_dir, replace(config, adapters=adapters))


def _merged(model_dir: Path, adapter_dir: Path, config: EngineConfig) -> LLMEngine:
    model_config = load_model_config(model_dir)
    model = load_model(model_dir, model_config, config.block_size, torch.float32)
    merge_adapter(model, load_adapter("merged", adapter_dir, model))
    return LLMEngine(model, load_tokenizer(model_dir, model_config), config)


def _rate(engine: LLMEngine, work: Workload, count: int) -> float:
    engine.generate([[7] * 32], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    names = [f"adapter-{i}" for i in range(count)]
    start = time.perf_counter()
    serve(engine, work, names)
    return work.num_output_tokens / (time.perf_counter() - start)
