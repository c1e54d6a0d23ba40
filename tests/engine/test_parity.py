"""Same weights, same numbers: our decoder against `transformers` in fp32.

Tolerance: logits agree within atol 1e-4 (observed differences are about 5e-6 on logits
of magnitude ~10); greedy tokens agree exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from engine import native  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.layers.linear import pack_linear_layers  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.loader import load_model, load_model_config  # noqa: E402
from engine.model_dirs.tiny import init_tiny_model  # noqa: E402
from engine.model_files import weight_files  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from tests.engine.helpers import paged_logits  # noqa: E402

ATOL = 1e-4
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
VARIANTS: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2-qkv-bias": {"architecture": "qwen2", "seed": 1},
    "llama-attention-bias": {"attention_bias": True, "seed": 2},
    "llama3-rope-scaling": {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0, "seed": 3},
    "tied-embeddings-mha": {"tie_word_embeddings": True, "kv_heads": 4, "seed": 4},
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp(request.param), **VARIANTS[request.param])


def _hf_model(model_dir: Path) -> Any:
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def _prompt(length: int, vocab: int, seed: int = 0) -> list[int]:
    return torch.randint(
        3, vocab, (length,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


def test_prefill_and_paged_decode_logits_match_transformers(variant_dir: Path) -> None:
    config = load_model_config(variant_dir)
    ours = load_model(variant_dir, config, block_size=4, dtype=torch.float32)
    ids = _prompt(90, config.vocab_size)
    with torch.no_grad():
        expected = _hf_model(variant_dir)(torch.tensor([ids])).logits[0]
    # Decodes through the PyTorch path, and through the native kernel where it builds;
    # then all again with the linear layers packed for oneDNN, where this build can.
    kernels = dict.fromkeys([None, native.paged_decode()])
    for packed in (False, True):
        if packed and not pack_linear_layers(ours):
            break
        for kernel in kernels:
            for chunks in ([90], [13, 40, 37], [30] + [1] * 60):
                got = paged_logits(ours, ids, chunks, decode_kernel=kernel)
                assert torch.allclose(got, expected, atol=ATOL, rtol=0), (
                    packed,
                    kernel,
                    chunks,
                    (got - expected).abs().max(),
                )


def test_greedy_generation_matches_transformers(variant_dir: Path) -> None:
    engine = LLMEngine.from_model_dir(variant_dir, EngineConfig(num_kv_blocks=128, block_size=4))
    hf = _hf_model(variant_dir)
    prompts = [_prompt(n, engine.model_config.vocab_size, seed=n) for n in (5, 17, 33)]
    results = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0))
    for prompt, result in zip(prompts, results, strict=True):
        with torch.no_grad():
            generated = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=24,
                do_sample=False,
                pad_token_id=2,
            )
        assert list(result.token_ids) == generated[0, len(prompt) :].tolist()


def test_sharded_checkpoint_loads_the_same_model(tmp_path: Path) -> None:
    single = init_tiny_model(tmp_path / "single", seed=7)
    sharded = init_tiny_model(tmp_path / "sharded", seed=7, num_shards=3)
    assert len(weight_files(sharded)) == 3
    assert (sharded / "model.safetensors.index.json").is_file()
    config = load_model_config(single)
    ids = _prompt(20, config.vocab_size)
    a = paged_logits(load_model(single, config, 4, torch.float32), ids, [20])
    b = paged_logits(load_model(sharded, config, 4, torch.float32), ids, [20])
    assert torch.equal(a, b)
    with torch.no_grad():
        expected = _hf_model(sharded)(torch.tensor([ids])).logits[0]
    assert torch.allclose(b, expected, atol=ATOL, rtol=0)
