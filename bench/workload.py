"""The benchmarks' model and request mixes: a ~50M-parameter random Llama, seeded prompts."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import ModelConfig
from engine.model_dirs.tiny import init_tiny_model

# 8 layers of 2.95M (8 heads of 64, 4 KV heads, MLP 1408) plus 2 x 16.4M of embedding and
# LM head over a 32000-token vocabulary: 56M parameters. The tokenizer stays the small
# trained one; workloads draw ids from the whole vocabulary.
MODEL_SHAPE: dict[str, Any] = {
    "layers": 8,
    "hidden": 512,
    "intermediate": 1408,
    "heads": 8,
    "kv_heads": 4,
    "model_vocab": 32000,
}
# Ids below this are the tokenizer's special tokens (BOS, EOS, PAD ...).
FIRST_ORDINARY_ID = 6


def make_model(model_dir: Path) -> Path:
    return init_tiny_model(model_dir, **MODEL_SHAPE)


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def make_workload(
    name: str,
    num_requests: int,
    vocab: int,
    seed: int,
    prompt_lens: tuple[int, int],
    output_lens: tuple[int, int],
    prefix_len: int = 0,
) -> Workload:
    """Random prompts with lengths uniform in `prompt_lens` (inclusive), each after the
    same `prefix_len` random tokens; output lengths uniform in `output_lens`."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(n)]

    prefix = tokens(prefix_len)
    prompts = [prefix + tokens(rng.randint(*prompt_lens)) for _ in range(num_requests)]
    return Workload(name, prompts, [rng.randint(*output_lens) for _ in range(num_requests)])


def _layer_params(cfg: ModelConfig) -> tuple[int, int]:
    """One decoder layer's weights: the query, key and value projections, and the rest
    (the output projection and the MLP)."""
    hidden, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return hidden * (q + 2 * kv), q * hidden + 3 * hidden * cfg.intermediate_size


def linear_params(cfg: ModelConfig) -> int:
    """Weights every token multiplies through: the decoder's projections and the LM head."""
    qkv, rest = _layer_params(cfg)
    return cfg.num_layers * (qkv + rest) + cfg.hidden_size * cfg.vocab_size


def matmul_flops(cfg: ModelConfig, work: Workload) -> float:
    """The matrix-multiply FLOPs of serving `work` with no prefix cached and no preemption.

    Each prompt token and each output token fed back goes through every layer's query,
    key and value projections, and through the rest of every layer but the last. The
    rows that sample, one per output token, also take the last layer's output projection
    and MLP, and the LM head: the engine computes those for them alone.
    """
    qkv, rest = _layer_params(cfg)
    rows = work.num_prompt_tokens + work.num_output_tokens - len(work.prompts)
    every_row = cfg.num_layers * qkv + (cfg.num_layers - 1) * rest
    sampling_row = rest + cfg.hidden_size * cfg.vocab_size
    return 2.0 * (every_row * rows + sampling_row * work.num_output_tokens)


def decode_flops(cfg: ModelConfig, num_tokens: int, context_sum: int) -> float:
    """FLOPs of `num_tokens` decode steps whose contexts add up to `context_sum` positions:
    2 per weight, plus q.k and p.v over the context for every head of every layer."""
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context_sum
    return 2.0 * linear_params(cfg) * num_tokens + attention
