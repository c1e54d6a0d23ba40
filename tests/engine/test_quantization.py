"""Int8 weights and a bfloat16 KV cache against the fp32 engine on the tiny model.

Tolerances, against fp32 on logits of standard deviation ~2: int8 weights within 0.3
absolute (observed ~0.13), mean KL(fp32 || int8) below 2e-3 (observed ~2.5e-4);
bfloat16 KV within 0.05 (observed ~0.013), mean KL below 1e-4 (observed ~1e-6).
Greedy tokens agree on at least 90% of teacher-forced positions (observed 95-100%).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import cast

import pytest
import torch
import torch.nn.functional as F

from engine import native
from engine.config import EngineConfig
from engine.layers.linear import Linear
from engine.layers.quantized import DequantBuffer, Int8Linear, quantize_int8
from engine.layers.tied import TiedHead
from engine.llm_engine import LLMEngine
from engine.loader import load_model, load_model_config
from engine.model_dirs.tiny import init_tiny_model
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from engine.sampling import SamplingParams
from tests.engine.helpers import paged_logits
from tests.engine.test_native_gemm import quantized_activations

MIN_AGREEMENT = 0.9
needs_gemm = pytest.mark.skipif(
    native.gemm() is None, reason="the native kernels did not build here"
)
# Prefill, then single-token decode steps, then a chunk that reads a cached prefix.
CHUNKS = [32, *[1] * 8, 24]


def _model(model_dir: Path) -> LlamaForCausalLM:
    return load_model(model_dir, load_model_config(model_dir), 4, torch.float32)


def _prompt(vocab: int, seed: int, length: int = sum(CHUNKS)) -> list[int]:
    return torch.randint(
        3, vocab, (length,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


def _mean_kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Mean over rows of KL(reference || other) between next-token distributions."""
    return float(
        F.kl_div(
            other.log_softmax(-1), reference.log_softmax(-1), log_target=True, reduction="none"
        )
        .sum(-1)
        .mean()
    )


def _agreement(reference: torch.Tensor, other: torch.Tensor) -> float:
    return float((reference.argmax(-1) == other.argmax(-1)).float().mean())


@pytest.mark.parametrize(
    ("option", "value"), [("quantization", "int4"), ("kv_dtype", "float8"), ("kv_dtype", "fp32")]
)
def test_an_unknown_option_value_is_rejected(option: str, value: str) -> None:
    with pytest.raises(ValueError, match=f"{option} '{value}' is not supported"):
        EngineConfig(**{option: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", [0, 1])
def test_int8_weights_keep_logits_close(tiny_dir: Path, seed: int) -> None:
    reference, quantized = _model(tiny_dir), _model(tiny_dir)
    quantize_int8(quantized)
    ids = _prompt(reference.config.vocab_size, seed)
    expected = paged_logits(reference, ids, CHUNKS)
    actual = paged_logits(quantized, ids, CHUNKS)
    assert (actual - expected).abs().max() < 0.3
    assert _mean_kl(expected, actual) < 2e-3
    assert _agreement(expected, actual) >= MIN_AGREEMENT


@pytest.mark.parametrize("seed", [0, 1])
def test_a_bfloat16_kv_cache_keeps_logits_close(tiny_dir: Path, seed: int) -> None:
    model = _model(tiny_dir)
    ids = _prompt(model.config.vocab_size, seed)
    expected = paged_logits(model, ids, CHUNKS)
    actual = paged_logits(model, ids, CHUNKS, kv_dtype=torch.bfloat16)
    assert (actual - expected).abs().max() < 0.05
    assert _mean_kl(expected, actual) < 1e-4
    assert _agreement(expected, actual) >= MIN_AGREEMENT


def test_int8_engine_greedy_tokens_agree_with_fp32(
    make_engine: Callable[..., LLMEngine],
) -> None:
    fp32, int8 = make_engine(), make_engine(quantization="int8")
    model = int8.runner.model
    layer = cast(LlamaDecoderLayer, model.model.layers[0])
    assert isinstance(layer.mlp.down_proj, Int8Linear)
    assert isinstance(model.lm_head, Int8Linear | TiedHead)
    vocab = model.config.vocab_size
    prompts = [_prompt(vocab, seed, length=20) for seed in range(3)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    continuations = [list(c.token_ids) for c in fp32.generate(prompts, params)]
    assert all(len(c.token_ids) == 24 for c in int8.generate(prompts, params))
    # Teacher forcing on the fp32 continuation, so one differing token does not compound.
    agreed = 0
    for prompt, continuation in zip(prompts, continuations, strict=True):
        logits = paged_logits(model, prompt + continuation, [len(prompt), *[1] * 24])
        predicted = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
        agreed += sum(p == t for p, t in zip(predicted, continuation, strict=True))
    assert agreed / (3 * 24) >= MIN_AGREEMENT


def test_a_bfloat16_kv_cache_holds_twice_the_blocks(
    make_engine: Callable[..., LLMEngine],
) -> None:
    fp32 = make_engine(num_kv_blocks=None, kv_cache_bytes=1 << 20)
    bf16 = make_engine(num_kv_blocks=None, kv_cache_bytes=1 << 20, kv_dtype="bfloat16")
    assert bf16.runner.kv_caches[0].dtype == torch.bfloat16
    assert bf16.num_total_blocks == 2 * fp32.num_total_blocks
    [completion] = bf16.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=8, temperature=0))
    assert len(completion.token_ids) == 8


def test_a_tied_lm_head_is_left_unquantized(tmp_path: Path) -> None:
    model = _model(init_tiny_model(tmp_path, tie_word_embeddings=True))
    # Two layers of qkv, o, gate_up and down; not the head that shares the embedding.
    assert quantize_int8(model) == 8
    assert isinstance(model.lm_head, Linear)
    assert model.lm_head.weight is model.model.embed_tokens.weight


@needs_gemm
def test_a_depth_off_the_activation_block_keeps_the_widening_panels() -> None:
    linear = Linear(100, 40, bias=False)  # 100 inputs: not a whole number of blocks of 32
    torch.nn.init.normal_(linear.weight, std=0.02)
    layer = Int8Linear(linear, DequantBuffer(torch.float32))
    assert layer.qweight.dtype == torch.int8 and layer.qweight.dim() == 3
    x = torch.randn(3, 100)
    dequantized = layer.int8_rows().float() * layer.scale.unsqueeze(1)
    torch.testing.assert_close(layer(x), F.linear(x, dequantized))


@pytest.mark.parametrize(
    "native_kernels",
    [pytest.param("1", marks=needs_gemm, id="panels"), pytest.param("0", id="chunks")],
)
def test_int8_linear_matches_its_dequantized_weight(
    monkeypatch: pytest.MonkeyPatch, native_kernels: str
) -> None:
    monkeypatch.setenv("TOLLGATE_NATIVE_KERNELS", native_kernels)
    # 4096 inputs: a chunk holds 256 rows, so 600 outputs take three chunks.
    linear = Linear(4096, 600, bias=True)
    torch.nn.init.normal_(linear.weight, std=0.02)
    assert linear.bias is not None
    torch.nn.init.normal_(linear.bias)
    layer = Int8Linear(linear, DequantBuffer(torch.float32))
    assert layer.rows_per_chunk < 600
    assert (layer.gemm is not None) == (native_kernels == "1")
    kernels = native.kernels()
    integer = kernels is not None and kernels.integer_panels
    assert layer.qweight.dtype == (torch.uint8 if integer else torch.int8)  # 4096: 128 blocks
    # Held once, in one layout: a byte a weight is what it saves.
    assert layer.qweight.numel() == 600 * 4096 + (-600 % 16) * 4096 * (native_kernels == "1")
    x = torch.randn(5, 4096)
    dequantized = layer.int8_rows().float() * layer.scale.unsqueeze(1)
    # Integer panels multiply the activations rounded to 8 bits (test_native_gemm.py).
    read = quantized_activations(x) if integer else x
    torch.testing.assert_close(layer(x), F.linear(read, dequantized, linear.bias))
    # Per-row rounding error is at most half a step of that row's scale.
    assert ((dequantized - linear.weight).abs() <= layer.scale.unsqueeze(1) / 2 + 1e-7).all()
