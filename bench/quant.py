"""What int8 weights and a bfloat16 KV cache cost in quality and buy in speed and memory.

    python -m bench.quant            # 16 prompts of 64-256 tokens, 64 tokens each
    python -m bench.quant --quick    # 16 prompts of 32-128 tokens, 24 tokens each

Model: as bench.engine's (bench/models.py): SmolLM2-135M-Instruct where it is fetched.
Variants: fp32, int8 weights, bf16 KV, both. Quality is measured three ways on text the
repository ships (bench/data/prose.txt: the Declaration of Independence and two addresses
of Abraham Lincoln, public domain, about 2,900 tokens of SmolLM2's tokenizer):

* perplexity: the text cut into windows of 512 tokens, each prefilled through the engine's
  paged KV cache, every next token scored; exp of the mean negative log-likelihood;
* exact match: the prompts (seeded windows of the same text) served greedily, all at once;
  the fraction of prompts whose whole continuation is fp32's, and (prefix) the mean
  fraction of a continuation that is fp32's before the first token that differs;
* agreement and KL: fp32's greedy continuation scored under teacher forcing (prompts
  prefilled together, then one forced token per sequence per decode step), so an early
  difference does not compound: the fraction of positions where the variant's argmax is
  fp32's token, and the mean KL(fp32 || variant) of the next-token distributions.

Speed is the decode throughput of the same greedy serving (output tokens over the time of
decode-only steps, best of 3 runs, the variants taking turns). Weight memory counts every
parameter and buffer of the model once. Table on stdout, progress on stderr, the last line
is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.engine import serve
from bench.models import add_model_option, model_name
from bench.models import model_dir as bench_model_dir
from bench.report import progress
from bench.workload import Workload
from engine.batch_inputs import build_inputs
from engine.batcher import ScheduledChunk, StepPlan
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader import load_model_config, load_tokenizer
from engine.model_runner import kv_cache_bytes_per_block
from engine.sampling import SamplingParams
from engine.sequence import Sequence
from engine.tokenizer import Tokenizer

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
PROSE = Path(__file__).parent / "data" / "prose.txt"
PERPLEXITY_WINDOW = 512


def prose_tokens(tokenizer: Tokenizer) -> list[int]:
    return tokenizer.encode(PROSE.read_text(), add_special_tokens=False)


def prose_prompts(text: list[int], prompts: PromptSet, seed: int) -> Workload:
    """`prompts.num_prompts` windows of the text at seeded places, of seeded lengths."""
    rng = random.Random(seed)
    windows = []
    for _ in range(prompts.num_prompts):
        length = rng.randint(*prompts.prompt_lens)
        start = rng.randrange(len(text) - length)
        windows.append(text[start : start + length])
    return Workload("prose", windows, [prompts.continuation_len] * prompts.num_prompts)


def perplexity(engine: LLMEngine, text: list[int], window: int = PERPLEXITY_WINDOW) -> float:
    """exp(mean negative log-likelihood) of every token of `text` after the first, the
    text prefilled a window at a time (each window on its own, from position 0)."""
    runner, manager = engine.runner, engine.block_manager
    nll, count = 0.0, 0
    for start in range(0, len(text) - 1, window):
        ids = text[start : start + window + 1]
        seq = Sequence(f"perplexity-{start}", ids[:-1], SamplingParams())
        manager.allocate(seq, seq.num_uncomputed_tokens)
        chunk = ScheduledChunk(seq, 0, seq.num_uncomputed_tokens)
        inputs = build_inputs(StepPlan((chunk,)), runner.shape, runner.workspace)
        with torch.inference_mode():
            hidden = runner.model(
                inputs.input_ids, inputs.positions, runner.kv_caches, inputs.attention
            )
            log_probs = runner.model.compute_logits(hidden).log_softmax(-1)
        targets = torch.tensor(ids[1:])
        nll -= float(log_probs.gather(1, targets[:, None]).sum())
        count += len(targets)
        manager.free(seq)
    return math.exp(nll / count)


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
) -> tuple[dict[str, float], dict[str, list[list[int]]]]:
    """Best decode tokens/s of each engine over `DECODE_RUNS` runs taken in turn, so that
    load from elsewhere falls on every variant alike; and each one's greedy output tokens."""
    rates: dict[str, float] = dict.fromkeys(engines, 0.0)
    greedy: dict[str, list[list[int]]] = {}
    for _ in range(DECODE_RUNS):
        for name, engine in engines.items():
            times, greedy[name] = serve(engine, work)
            rates[name] = max(rates[name], times.decode_tokens / times.decode_seconds)
    return rates, greedy


def exact_match(outputs: list[list[int]], reference: list[list[int]]) -> float:
    """The fraction of prompts whose whole greedy continuation is the reference's."""
    return sum(a == b for a, b in zip(outputs, reference, strict=True)) / len(reference)


def common_prefix(outputs: list[list[int]], reference: list[list[int]]) -> float:
    """The mean fraction of each greedy continuation that matches the reference's before
    the first token that differs."""
    fractions = []
    for output, expected in zip(outputs, reference, strict=True):
        pairs = enumerate(zip(output, expected, strict=True))
        same = next((i for i, (a, b) in pairs if a != b), len(expected))
        fractions.append(same / len(expected))
    return sum(fractions) / len(fractions)


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
        f"{'variant':<16} {'perplexity':>10} {'exact match':>11} {'prefix':>6} {'agreement':>9} "
        f"{'mean KL':>9} {'decode tok/s':>12} {'weights MiB':>11} {'KV KiB/token':>12}"
    )
    print(header)
    print("-" * len(header))
    for name, row in rows.items():
        print(
            f"{name:<16} {row['perplexity']:>10.3f} {row['exact_match']:>11.3f} "
            f"{row['common_prefix']:>6.3f} "
            f"{row['agreement']:>9.4f} {row['mean_kl']:>9.2e} "
            f"{row['decode_tokens_per_s']:>12.1f} {row['weight_mib']:>11.1f} "
            f"{row['kv_kib_per_token']:>12.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="shorter prompts and continuations")
    add_model_option(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    prompt_set = QUICK if args.quick else FULL
    started = time.perf_counter()
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = bench_model_dir(args.model, Path(scratch))
        text = prose_tokens(load_tokenizer(model_dir, load_model_config(model_dir)))
        work = prose_prompts(text, prompt_set, args.seed)
        engines: dict[str, LLMEngine] = {}
        for name, options in VARIANTS.items():
            progress(f"[{name}] loading")
            engine = LLMEngine.from_model_dir(
                model_dir, EngineConfig(kv_cache_bytes=KV_CACHE_BYTES, **options)
            )
            engine.generate([[7] * 32], SamplingParams(max_tokens=4, temperature=0))  # warm-up
            engines[name] = engine
        progress(f"serving {DECODE_RUNS} times per variant, in turn")
        rates, outputs = decode_rates(engines, work)
        continuations = outputs[REFERENCE]
        greedy = torch.tensor(continuations)
        progress(f"[{REFERENCE}] scoring its own continuation")
        reference = forced_log_probs(engines[REFERENCE], work, continuations)
        for name, engine in engines.items():
            if name == REFERENCE:
                log_probs = reference
            else:
                progress(f"[{name}] scoring the fp32 continuation")
                log_probs = forced_log_probs(engine, work, continuations)
            progress(f"[{name}] perplexity of the text")
            kv_dtype = engine.runner.kv_caches[0].dtype
            rows[name] = {
                "perplexity": round(perplexity(engine, text), 3),
                "exact_match": round(exact_match(outputs[name], continuations), 3),
                "common_prefix": round(common_prefix(outputs[name], continuations), 3),
                **accuracy(log_probs, reference, greedy),
                "decode_tokens_per_s": round(rates[name], 1),
                "weight_mib": round(weight_bytes(engine.runner.model) / 2**20, 1),
                "kv_kib_per_token": kv_cache_bytes_per_block(engine.model_config, 1, kv_dtype)
                / 1024,
            }
    print_table(rows)
    fp32 = rows[REFERENCE]
    figures = {
        "model": model_name(args.model),
        "quick": args.quick,
        "threads": torch.get_num_threads(),
        "prompts": prompt_set.num_prompts,
        "positions": prompt_set.num_prompts * prompt_set.continuation_len,
        "text_tokens": len(text),
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
