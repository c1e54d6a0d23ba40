"""A tied embedding and LM head held once as panels (`engine.layers.tied`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import native
from engine.config import EngineConfig
from engine.layers.linear import Linear
from engine.layers.tied import TiedEmbedding, TiedHead, tie_into_panels
from engine.llm_engine import LLMEngine
from engine.loader import load_model, load_model_config
from engine.model_dirs.tiny import init_tiny_model
from engine.models.llama import LlamaForCausalLM
from engine.sampling import SamplingParams
from tests.engine.helpers import paged_logits
from tests.engine.test_native_gemm import quantized_activations

pytestmark = pytest.mark.skipif(
    native.gemm() is None, reason="the native kernels did not build here"
)


def _model(model_dir: Path) -> LlamaForCausalLM:
    return load_model(model_dir, load_model_config(model_dir), 4, torch.float32)


@pytest.fixture
def tied_dir(tmp_path: Path) -> Path:
    # A vocabulary that is not a whole number of panels: the last one is padded.
    return init_tiny_model(tmp_path / "tied", tie_word_embeddings=True, model_vocab=515)


def test_fp32_panels_hold_the_embedding_exactly_and_multiply_as_the_head(tied_dir: Path) -> None:
    model = _model(tied_dir)
    weight = model.model.embed_tokens.weight.detach().clone()
    assert tie_into_panels(model, int8=False)
    assert isinstance(model.model.embed_tokens, TiedEmbedding)
    assert isinstance(model.lm_head, TiedHead)
    assert model.model.embed_tokens.tied is model.lm_head.tied  # one matrix, not two
    ids = torch.tensor([0, 1, 15, 16, 513, 514, 7, 7])
    assert torch.equal(model.model.embed_tokens(ids), weight[ids])
    hidden = torch.randn(3, weight.shape[1])
    torch.testing.assert_close(model.compute_logits(hidden), hidden @ weight.T)


def test_int8_panels_stay_within_half_a_step_of_each_row(tied_dir: Path) -> None:
    model = _model(tied_dir)
    weight = model.model.embed_tokens.weight.detach().clone()
    assert tie_into_panels(model, int8=True)
    tied = model.lm_head.tied
    kernels = native.kernels()
    integer = kernels is not None and kernels.integer_panels and weight.shape[1] % 32 == 0
    assert tied.panels.dtype == (torch.uint8 if integer else torch.int8)
    assert tied.scale is not None
    ids = torch.arange(weight.shape[0])
    rows = model.model.embed_tokens(ids)
    assert ((rows - weight).abs() <= tied.scale.unsqueeze(1) / 2 + 1e-6).all()
    hidden = torch.randn(4, weight.shape[1])
    # Integer panels multiply the activations rounded to 8 bits (test_native_gemm.py).
    read = quantized_activations(hidden) if integer else hidden
    torch.testing.assert_close(model.compute_logits(hidden), read @ rows.T)


def test_an_untied_head_is_left_as_it_is(tmp_path: Path) -> None:
    model = _model(init_tiny_model(tmp_path / "untied", tie_word_embeddings=False))
    assert not tie_into_panels(model, int8=True)
    assert isinstance(model.lm_head, Linear)


def test_the_engine_on_tied_panels_generates_what_the_plain_model_does(tied_dir: Path) -> None:
    prompts = [[5, 6, 7, 8, 9, 10], [300, 200, 100]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    engine = LLMEngine.from_model_dir(tied_dir, EngineConfig(num_kv_blocks=64, block_size=4))
    assert isinstance(engine.runner.model.lm_head, TiedHead)
    plain = _model(tied_dir)  # as loaded: an embedding and a head of plain products
    for prompt, completion in zip(prompts, engine.generate(prompts, params), strict=True):
        tokens = list(completion.token_ids)
        logits = paged_logits(plain, prompt + tokens, [len(prompt), *[1] * len(tokens)])
        assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == tokens
