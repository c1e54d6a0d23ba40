"""`tollgate models inspect`: a model's parameters, weight bytes and KV cache needs.

Pure arithmetic over a `ModelConfig` and the checkpoint's tensor shapes: reading the
model directory is the command's job (`engine.commands.models`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass

from engine.config import ModelConfig

# Element sizes of the dtypes the engine runs (`engine.loader.DTYPES`).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Int8Linear keeps one fp32 scale per output row.
INT8_SCALE_BYTES = 4
KINDS = ("embeddings", "attention", "mlp", "norms", "lm_head")


@dataclass(frozen=True, slots=True)
class ParameterCounts:
    """Parameters by kind; `linear_*` are the 2-D weights int8 quantizes and their rows (a
    tied embedding among them: it is held once, as the LM head's int8 panels)."""

    embeddings: int
    attention: int
    mlp: int
    norms: int
    lm_head: int
    linear_weights: int
    linear_rows: int

    @property
    def total(self) -> int:
        return self.embeddings + self.attention + self.mlp + self.norms + self.lm_head


@dataclass(frozen=True, slots=True)
class WeightBytes:
    """The weights' size when the engine runs them as `quantization`."""

    quantization: str
    total_bytes: int
    bytes_per_weight: float


@dataclass(frozen=True, slots=True)
class KVCacheFigures:
    """The KV cache `concurrency` sequences of `num_tokens` need, ideal and paged."""

    num_tokens: int
    concurrency: int
    kv_dtype: str
    block_size: int
    bytes_per_token: int
    theoretical_bytes: int
    blocks_per_seq: int
    bytes_per_block: int
    pool_bytes: int
    overhead_bytes: int
    budget_blocks: int
    num_seqs_fit: int


@dataclass(frozen=True, slots=True)
class ModelReport:
    """What `models inspect` prints about one model."""

    name: str
    config: ModelConfig
    params: ParameterCounts
    weights: tuple[WeightBytes, ...]
    kv: KVCacheFigures


def parameter_kind(name: str) -> str:
    """The kind of a Hugging Face Llama/Qwen2 tensor name (one of KINDS)."""
    if "embed_tokens" in name:
        return "embeddings"
    if name.startswith("lm_head"):
        return "lm_head"
    if "norm" in name:
        return "norms"
    if ".self_attn." in name:
        return "attention"
    if ".mlp." in name:
        return "mlp"
    raise ValueError(f"unknown weight {name!r}")


def count_parameters(
    shapes: Iterable[tuple[str, tuple[int, ...]]], tie_word_embeddings: bool
) -> ParameterCounts:
    """Counts from (name, shape) pairs; a tied LM head is the embedding, counted once."""
    counts = dict.fromkeys(KINDS, 0)
    linear_weights = linear_rows = 0
    for name, shape in shapes:
        if name.endswith("rotary_emb.inv_freq") or (
            name == "lm_head.weight" and tie_word_embeddings
        ):
            continue
        kind = parameter_kind(name)
        numel = math.prod(shape)
        counts[kind] += numel
        tied = kind == "embeddings" and tie_word_embeddings
        if (tied or kind in ("attention", "mlp", "lm_head")) and len(shape) == 2:
            linear_weights += numel
            linear_rows += shape[0]
    return ParameterCounts(**counts, linear_weights=linear_weights, linear_rows=linear_rows)


def weight_bytes(params: ParameterCounts) -> tuple[WeightBytes, ...]:
    """fp32, bf16 and int8 (int8 rows and an fp32 scale per row for the linear layers and a
    tied embedding, everything else in fp32)."""
    rest = params.total - params.linear_weights
    int8 = params.linear_weights + params.linear_rows * INT8_SCALE_BYTES + rest * 4
    sizes = (
        ("float32", params.total * 4),
        ("bfloat16", params.total * 2),
        ("int8", int8),
    )
    return tuple(WeightBytes(q, size, size / max(1, params.total)) for q, size in sizes)


def kv_cache_figures(
    config: ModelConfig,
    *,
    num_tokens: int,
    concurrency: int,
    kv_dtype: str,
    block_size: int,
    budget_blocks: int | None = None,
    budget_bytes: int | None = None,
) -> KVCacheFigures:
    """`kv_dtype` is resolved (no "auto"); the budget is blocks, else bytes (as LLMEngine
    sizes its pool: at least one block), else none."""
    per_token = config.kv_bytes_per_token(DTYPE_BYTES[kv_dtype])
    per_block = per_token * block_size
    # RequestLimits.blocks_needed: a sequence holds whole blocks.
    blocks_per_seq = -(-num_tokens // block_size)
    theoretical = per_token * num_tokens * concurrency
    pool = per_block * blocks_per_seq * concurrency
    if budget_blocks is None:
        budget_blocks = max(1, budget_bytes // per_block) if budget_bytes is not None else 0
    return KVCacheFigures(
        num_tokens=num_tokens,
        concurrency=concurrency,
        kv_dtype=kv_dtype,
        block_size=block_size,
        bytes_per_token=per_token,
        theoretical_bytes=theoretical,
        blocks_per_seq=blocks_per_seq,
        bytes_per_block=per_block,
        pool_bytes=pool,
        overhead_bytes=pool - theoretical,
        budget_blocks=budget_blocks,
        num_seqs_fit=budget_blocks // blocks_per_seq,
    )


def report_json(report: ModelReport) -> str:
    data = {
        "name": report.name,
        "config": dataclasses.asdict(report.config),
        "params": {**dataclasses.asdict(report.params), "total": report.params.total},
        "weights": [dataclasses.asdict(w) for w in report.weights],
        "kv": dataclasses.asdict(report.kv),
    }
    return json.dumps(data, indent=2)


def report_text(report: ModelReport) -> str:
    cfg, params, kv = report.config, report.params, report.kv
    lines = [
        f"{report.name} ({cfg.architecture})",
        f"  layers {cfg.num_layers}, hidden {cfg.hidden_size}, heads {cfg.num_heads} "
        f"(KV heads {cfg.num_kv_heads}), head dim {cfg.head_dim}, "
        f"intermediate {cfg.intermediate_size}",
        f"  vocabulary {cfg.vocab_size}, context {cfg.max_position_embeddings}, "
        f"tied embeddings {'yes' if cfg.tie_word_embeddings else 'no'}",
        f"parameters {params.total:,}",
        *(f"  {kind:<11}{getattr(params, kind):>15,}" for kind in KINDS),
        "weights",
        *(
            f"  {w.quantization:<11}{_size(w.total_bytes):>15}  {w.bytes_per_weight:.2f} B/weight"
            for w in report.weights
        ),
        f"KV cache for {kv.concurrency} x {kv.num_tokens} tokens, {kv.kv_dtype}",
        f"  per token {_size(kv.bytes_per_token)}, theoretical {_size(kv.theoretical_bytes)}",
        f"  block of {kv.block_size} tokens {_size(kv.bytes_per_block)}, "
        f"{kv.blocks_per_seq} blocks per sequence",
        f"  pool {_size(kv.pool_bytes)} (rounding overhead {_size(kv.overhead_bytes)})",
        f"  {kv.num_seqs_fit} such sequences fit in {kv.budget_blocks} blocks "
        f"({_size(kv.budget_blocks * kv.bytes_per_block)}), without prefix sharing",
    ]
    return "\n".join(lines)


def _size(num_bytes: int) -> str:
    if num_bytes < 1024:
        return f"{num_bytes} B"
    value = num_bytes / 1024
    for unit in ("KiB", "MiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"
