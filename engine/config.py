"""Model and engine configuration, parsed from a Hugging Face `config.json`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.errors import UnsupportedModelError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
QUANTIZATIONS = ("int8",)
KV_DTYPES = ("auto", "float32", "bfloat16")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding parameters; `rope_type` selects how inverse frequencies are scaled."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The decoder's shape and options, independent of where the weights come from."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def kv_bytes_per_token(self, element_size: int) -> int:
        """Keys and values of every layer for one token, at `element_size` bytes each."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How the engine runs a model: KV cache size, batching budget, numerics.

    `num_kv_blocks` fixes the pool size; when None the pool takes `kv_cache_bytes`.
    `max_model_len` defaults to the model's `max_position_embeddings`.
    `quantization="int8"` stores the linear layers' weights as int8 with one scale per
    output channel (embeddings and norms stay in `dtype`). `kv_dtype` is the KV cache's
    storage dtype; "auto" is the model's dtype. Attention still computes in the model's dtype.
    A request names one of `adapters` (or none, for the base model).
    """

    block_size: int = 16
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 128
    num_kv_blocks: int | None = None
    kv_cache_bytes: int = 1 << 30
    max_model_len: int | None = None
    dtype: str = "float32"
    enable_prefix_caching: bool = True
    # LoRA adapters served beside the base model: (model name, PEFT directory).
    adapters: tuple[tuple[str, str], ...] = ()
    num_threads: int | None = None
    seed: int = 0
    quantization: str | None = None
    kv_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.max_num_batched_tokens <= 0 or self.max_num_seqs <= 0:
            raise ValueError("block_size, max_num_batched_tokens and max_num_seqs must be positive")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError("num_kv_blocks must be positive")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization {self.quantization!r} is not supported "
                f"(supported: None, {', '.join(map(repr, QUANTIZATIONS))})"
            )
        names = [name for name, _ in self.adapters]
        if len(set(names)) != len(names) or "" in names:
            raise ValueError("adapter names must be unique and not empty")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(
                f"kv_dtype {self.kv_dtype!r} is not supported "
                f"(supported: {', '.join(map(repr, KV_DTYPES))})"
            )


def model_config_from_hf(raw: Mapping[str, Any]) -> ModelConfig:
    """Translate a Hugging Face `config.json` dict; raise UnsupportedModelError on what we cannot run."""
    architecture = _architecture(raw)
    _reject_unsupported_options(raw)
    hidden = int(raw["hidden_size"])
    heads = int(raw["num_attention_heads"])
    is_qwen2 = architecture == "Qwen2ForCausalLM"
    attention_bias = bool(raw.get("attention_bias", False))
    eos = raw.get("eos_token_id")
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        max_position_embeddings=_max_positions(raw),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=rope_config_from_hf(raw),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=is_qwen2 or attention_bias,
        o_bias=attention_bias and not is_qwen2,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_int_tuple(eos),
    )


def rope_config_from_hf(raw: Mapping[str, Any]) -> RopeConfig:
    """Read rope settings from either `rope_scaling` + `rope_theta` or the newer `rope_parameters`."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    merged = {**params, **scaling}
    theta = float(merged.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = str(merged.get("rope_type", merged.get("type", "default")))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope scaling type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    original = merged.get("original_max_position_embeddings") or raw.get(
        "max_position_embeddings", 8192
    )
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original),
    )


def _architecture(raw: Mapping[str, Any]) -> str:
    architectures = raw.get("architectures") or []
    supported = [name for name in architectures if name in SUPPORTED_ARCHITECTURES]
    if not supported:
        raise UnsupportedModelError(
            f"architecture {architectures or raw.get('model_type')!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return str(supported[0])


def _reject_unsupported_options(raw: Mapping[str, Any]) -> None:
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only 'silu')")
    for key in (
        "hidden_size",
        "num_attention_heads",
        "num_hidden_layers",
        "intermediate_size",
        "vocab_size",
    ):
        if key not in raw:
            raise UnsupportedModelError(f"config.json lacks required key {key!r}")
    if raw.get("pretraining_tp", 1) not in (1, None):
        raise UnsupportedModelError("pretraining_tp > 1 is not supported")


def _max_positions(raw: Mapping[str, Any]) -> int:
    positions = int(raw.get("max_position_embeddings", 2048))
    window = raw.get("sliding_window")
    # Without a sliding-window kernel, a windowed model is exact only up to its window.
    if window and raw.get("use_sliding_window", True):
        return min(positions, int(window))
    return positions


def _int_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def switched_on(name: str) -> bool:
    """Whether the environment leaves an on-by-default switch on: anything but `0`,
    `false`, `no` or `off`."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")
