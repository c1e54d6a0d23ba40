"""Offline throughput: the engine against `transformers` generate() in static batches.

    python -m bench.engine                      # ~50M Llama, 64 requests, both sides
    python -m bench.engine --skip-baseline --requests 16

Workload: prompts of 16-512 random tokens, 16-128 output tokens each (EOS ignored),
greedy, fp32. Throughput counts the output tokens each request asked for; the baseline
pads prompts on the left and runs every batch to its longest output.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams
from engine.tiny import init_tiny_model

# About 50M parameters, shaped like a scaled-down Llama 3.2: 12 layers of 3.8M (8 heads of 64,
# 2 KV heads, MLP 4x) plus 4M of embeddings and LM head.
MODEL_SHAPE: dict[str, Any] = {
    "layers": 12,
    "hidden": 512,
    "heads": 8,
    "kv_heads": 2,
    "intermediate": 2048,
    "vocab": 4096,
}


@dataclass(frozen=True, slots=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(num_requests: int, vocab: int, seed: int) -> Workload:
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(6, vocab) for _ in range(rng.randint(16, 512))] for _ in range(num_requests)
    ]
    return Workload(prompts, [rng.randint(16, 128) for _ in range(num_requests)])


def run_engine(model_dir: Path, work: Workload, config: EngineConfig) -> dict[str, Any]:
    engine = LLMEngine.from_model_dir(model_dir, config)
    engine.generate([[7] * 32], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    params = [
        SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in work.output_lens
    ]
    start = time.perf_counter()
    results = engine.generate(work.prompts, params)
    elapsed = time.perf_counter() - start
    assert [len(r.token_ids) for r in results] == work.output_lens
    ttfts = sorted(r.metrics.ttft or 0.0 for r in results)
    itls = [r.metrics.itl_mean for r in results if r.metrics.itl_mean is not None]
    return {
        "seconds": round(elapsed, 2),
        "output_tokens_per_s": round(work.num_output_tokens / elapsed, 1),
        "ttft_p50_s": round(statistics.median(ttfts), 3),
        "ttft_p95_s": round(ttfts[int(0.95 * (len(ttfts) - 1))], 3),
        "itl_mean_s": round(statistics.mean(itls), 4),
        "preemptions": sum(r.metrics.num_preemptions for r in results),
    }


def run_transformers(model_dir: Path, work: Workload, batch_size: int) -> dict[str, Any]:
    import transformers

    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    _hf_batch(model, [[7] * 32], 4)  # warm-up
    start = time.perf_counter()
    for i in range(0, len(work.prompts), batch_size):
        _hf_batch(
            model, work.prompts[i : i + batch_size], max(work.output_lens[i : i + batch_size])
        )
    elapsed = time.perf_counter() - start
    return {
        "seconds": round(elapsed, 2),
        "output_tokens_per_s": round(work.num_output_tokens / elapsed, 1),
    }


def _hf_batch(model: Any, prompts: list[list[int]], max_new_tokens: int) -> None:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[2] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        model.generate(
            ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=2
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", type=Path, help="model directory (default: a fresh ~50M random Llama)"
    )
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8, help="baseline static batch size")
    parser.add_argument("--max-batched-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--skip-baseline", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = args.model or init_tiny_model(Path(scratch) / "model", **MODEL_SHAPE)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        work = make_workload(args.requests, vocab, args.seed)
        config = EngineConfig(
            max_num_batched_tokens=args.max_batched_tokens, kv_cache_bytes=2 << 30
        )
        report: dict[str, Any] = {
            "requests": args.requests,
            "output_tokens": work.num_output_tokens,
            "threads": torch.get_num_threads(),
            "engine": run_engine(model_dir, work, config),
        }
        # The baseline takes minutes: show the engine's side as soon as it is known.
        print(json.dumps({"engine": report["engine"]}), file=sys.stderr, flush=True)
        if not args.skip_baseline:
            report["transformers"] = run_transformers(model_dir, work, args.batch_size)
            report["speedup"] = round(
                report["transformers"]["seconds"] / report["engine"]["seconds"], 2
            )
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
