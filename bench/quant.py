"""What int8 weights and a bfloat16 KV cache cost in accuracy and buy in speed and memory.

    python -m bench.quant            # 16 prompts of 64-256 tokens, 64 tokens each
    python -m bench.quant --quick    # 16 prompts of 32-128 tokens, 24 tokens each

Model: the ~50M-parameter random Llama of bench.engine. For each variant (fp32, int8
weights, bf16 KV, both) the engine first serves the seeded prompts greedily, all at once,
for its decode throughput (output tokens over the time of decode-only steps, best of 3
runs, the variants taking turns). Then it scores the fp32 greedy continuation under
teacher forcing (prompts prefilled together, then one forced token per sequence per
decode step), so an early difference does not compound: agreement is the fraction of
positions where the variant's argmax is fp32's greedy token, KL the mean
KL(fp32 || variant) of the next-token distributions over the same positions. Weight memory counts every parameter and buffer of the model once.
Table on stdout, progress on stderr, the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.engine import serve
from bench.report import progress
from bench.workload import Workload, make_model, make_workload
from engine.batch_inputs import build_inputs
from engine.batcher import ScheduledChunk, StepPlan
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_runner import kv_cache_bytes_per_block
from engine.sampling import SamplingParams
from engine.sequence import Sequence

REFERENCE = "fp32"
VARIANTS: dict[str, dict[str, Any]] = {
    REFERENCE: {},
    "int8 weights": {"quantization": "int8"},
    "bf16 KV": {"kv_dtype": "bfloat16"},
    "int8 + bf16 KV": {"quantization": "int8", "kv_dtype": "bfloat16"},
}


@dataclass(frozen=True, slots=True)
class PromptSet:
    num_prompts: int
    prompt_lens: tuple[int, int]
    continuation_len: int


# The machine's cores are shared: the best of a few runs is the least disturbed one.
DECODE_RUNS = 3
KV_CACHE_BYTES = 256 << 20
FULL = PromptSet(16, (64, 256), 64)
QUICK = PromptSet(16, (32, 128), 24)


def forced_log_probs(
    engine: LLMEngine, work: Workload, continuations: list[list[int]]
) -> torch.Tensor:
    """Next-token log-probabilities [prompts, continuation length, vocab] along the given
    continuations, computed through the engine's paged KV cache."""
    runner, manager = engine.runner, engine.block_manager
    seqs = [Sequence(f"forced-{i}", p, SamplingParams()) for i, p in enumerate(work.prompts)]
    length = len(continuations[0])
    result = torch.empty(len(seqs), length, engine.model_config.vocab_size)
    for step in range(length):
        chunks = []
        for seq in seqs:
            manager.allocate(seq, seq.num_uncomputed_tokens)
            chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, seq.num_uncomputed_tokens))
        inputs = build_inputs(StepPlan(tuple(chunks)), runner.shape, runner.workspace)
        with torch.inference_mode():
            hidden = runner.model(
                inputs.input_ids,
                inputs.positions,
                runner.kv_caches,
                inputs.attention,
                keep=inputs.logits_indices,
            )
            logits = runner.model.compute_logits(hidden)
        for row, chunk in zip(logits.log_softmax(-1), inputs.sampled, strict=True):
            result[seqs.index(chunk.seq), step] = row
        for i, (seq, chunk) in enumerate(zip(seqs, chunks, strict=True)):
            seq.num_computed_tokens += chunk.num_tokens
            seq.append_token(continuations[i][step], 0.0)
    for seq in seqs:
        manager.free(seq)
    return result


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of the module's parameters and buffers, a shared tensor counted once. Packed
    weights have an opaque layout and no storage to share: they count by identity."""
    tensors = {
        t.data_ptr() if t.layout == torch.strided else id(t): t
        for t in [*module.parameters(), *module.buffers()]
    }
    return sum(t.numel() * t.element_size() for t in tensors.values())


def decode_rates(
    engines: dict[str, LLMEngine], work: Workload
) -> tuple[dict[str, float], list[list[int]]]:
    """Best decode tokens/s of each engine over `DECODE_RUNS` runs taken in turn, so that
    load from elsewhere falls on every variant alike; and fp32's greedy output tokens."""
    rates: dict[str, float] = dict.fromkeys(engines, 0.0)
    greedy: list[list[int]] = []
    for _ in range(DECODE_RUNS):
        for name, engine in engines.items():
            times, tokens = serve(engine, work)
            rates[name] = max(rates[name], times.decode_tokens / times.decode_seconds)
            if name == REFERENCE:
                greedy = tokens
    return rates, greedy


def accuracy(
    log_probs: torch.Tensor, reference: torch.Tensor, greedy: torch.Tensor
) -> dict[str, float]:
    """Agreement of the argmax with fp32's greedy tokens, and mean KL(fp32 || variant)."""
    kl = F.kl_div(log_probs, reference, log_target=True, reduction="none").sum(-1)
    return {
        "agreement": round(float((log_probs.argmax(-1) == greedy).float().mean()), 4),
        "mean_kl": float(f"{float(kl.mean()):.3g}"),
    }


def print_table(rows: dict[str, dict[str, Any]]) -> None:
    header = (
        f"{'variant':<16} {'agreement':>9} {'mean KL':>9} {'decode tok/s':>12} "
        f"{'weights MiB':>11} {'KV KiB/token':>12}"
    )
    print(header)
    print("-" * len(header))
    for name, row in rows.items():
        print(
            f"{name:<16} {row['agreement']:>9.4f} {row['mean_kl']:>9.2e} "
            f"{row['decode_tokens_per_s']:>12.1f} {row['weight_mib']:>11.1f} "
            f"{row['kv_kib_per_token']:>12.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="shorter prompts and continuations")
    parser.add_argument("--model", type=Path, help="model directory (default: a fresh ~50M Llama)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    prompt_set = QUICK if args.quick else FULL
    started = time.perf_counter()
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        progress("writing the model")
        model_dir = args.model or make_model(Path(scratch) / "model")
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        length = prompt_set.continuation_len
        work = make_workload(
            "prompts",
            prompt_set.num_prompts,
            vocab,
            args.seed,
            prompt_set.prompt_lens,
            (length, length),
        )
        engines: dict[str, LLMEngine] = {}
        for name, options in VARIANTS.items():
            progress(f"[{name}] loading")
            engine = LLMEngine.from_model_dir(
                model_dir, EngineConfig(kv_cache_bytes=KV_CACHE_BYTES, **options)
            )
            engine.generate([[7] * 32], SamplingParams(max_tokens=4, temperature=0))  # warm-up
            engines[name] = engine
        progress(f"serving {DECODE_RUNS} times per variant, in turn")
        rates, continuations = decode_rates(engines, work)
        greedy = torch.tensor(continuations)
        progress(f"[{REFERENCE}] scoring its own continuation")
        reference = forced_log_probs(engines[REFERENCE], work, continuations)
        for name, engine in engines.items():
            if name == REFERENCE:
                log_probs = reference
            else:
                progress(f"[{name}] scoring the fp32 continuation")
                log_probs = forced_log_probs(engine, work, continuations)
            kv_dtype = engine.runner.kv_caches[0].dtype
            rows[name] = {
                **accuracy(log_probs, reference, greedy),
                "decode_tokens_per_s": round(rates[name], 1),
                "weight_mib": round(weight_bytes(engine.runner.model) / 2**20, 1),
                "kv_kib_per_token": kv_cache_bytes_per_block(engine.model_config, 1, kv_dtype)
                / 1024,
            }
    print_table(rows)
    fp32 = rows[REFERENCE]
    figures = {
        "quick": args.quick,
        "threads": torch.get_num_threads(),
        "prompts": prompt_set.num_prompts,
        "positions": prompt_set.num_prompts * prompt_set.continuation_len,
        "variants": rows,
        "int8_decode_speedup": round(
            rows["int8 weights"]["decode_tokens_per_s"] / fp32["decode_tokens_per_s"], 2
        ),
        "int8_weight_ratio": round(rows["int8 weights"]["weight_mib"] / fp32["weight_mib"], 3),
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
