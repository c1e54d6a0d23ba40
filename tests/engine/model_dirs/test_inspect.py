from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from engine.config import EngineConfig, ModelConfig
from engine.llm_engine import LLMEngine
from engine.loader import load_model_config
from engine.model_dirs.inspect import KVCacheFigures, count_parameters, kv_cache_figures
from engine.model_files import weight_files
from tollgate.cli import main

ROOT = Path(__file__).resolve().parents[3]


def inspect_json(*argv: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "tollgate.cli", "models", "inspect", *argv, "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    return json.loads(result.stdout)


def safetensors_numel(model_dir: Path) -> int:
    total = 0
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt") as handle:
            total += sum(handle.get_tensor(name).numel() for name in handle.keys())
    return total


@pytest.mark.parametrize(("kv_dtype", "block_size"), [("auto", 16), ("bfloat16", 8)])
def test_the_figures_are_what_the_engine_allocates(
    tiny_model_dir: Path, kv_dtype: str, block_size: int
) -> None:
    num_blocks, context, concurrency = 24, 37, 3
    engine = LLMEngine.from_model_dir(
        tiny_model_dir,
        EngineConfig(block_size=block_size, num_kv_blocks=num_blocks, kv_dtype=kv_dtype),
    )
    allocated = sum(t.numel() * t.element_size() for t in engine.runner.kv_caches)

    report = inspect_json(
        str(tiny_model_dir),
        "--context",
        str(context),
        "--concurrency",
        str(concurrency),
        "--kv-dtype",
        kv_dtype,
        "--block-size",
        str(block_size),
        "--kv-blocks",
        str(num_blocks),
    )

    kv = report["kv"]
    assert kv["kv_dtype"] == engine.kv_dtype
    assert kv["bytes_per_block"] * num_blocks == allocated
    assert kv["blocks_per_seq"] == engine.limits.blocks_needed(context)
    assert kv["pool_bytes"] == kv["bytes_per_block"] * kv["blocks_per_seq"] * concurrency
    assert kv["num_seqs_fit"] == num_blocks // engine.limits.blocks_needed(context)
    assert report["params"]["total"] == safetensors_numel(tiny_model_dir)


def test_a_byte_budget_holds_the_blocks_the_engine_would_make_of_it(tiny_model_dir: Path) -> None:
    budget = 100_000
    engine = LLMEngine.from_model_dir(tiny_model_dir, EngineConfig(kv_cache_bytes=budget))
    report = inspect_json(str(tiny_model_dir), "--kv-bytes", str(budget))
    assert report["kv"]["budget_blocks"] == engine.num_total_blocks


def test_the_text_report_names_the_figures(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["models", "inspect", str(tiny_model_dir), "--context", "100"]) == 0
    text = capsys.readouterr().out
    config = load_model_config(tiny_model_dir)
    assert f"layers {config.num_layers}, hidden {config.hidden_size}" in text
    assert "7 blocks per sequence" in text
    assert "int8" in text and "rounding overhead" in text


def test_a_missing_model_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "inspect", str(tmp_path / "nothing")]) == 1
    assert "not a model directory" in capsys.readouterr().err


def test_paged_rounding_is_the_tail_of_the_last_block() -> None:
    config = model_config(layers=2, kv_heads=2, head_dim=16)
    kv = kv_cache_figures(
        config, num_tokens=17, concurrency=2, kv_dtype="float32", block_size=16, budget_blocks=9
    )
    assert kv == KVCacheFigures(
        num_tokens=17,
        concurrency=2,
        kv_dtype="float32",
        block_size=16,
        bytes_per_token=512,
        theoretical_bytes=512 * 17 * 2,
        blocks_per_seq=2,
        bytes_per_block=512 * 16,
        pool_bytes=512 * 16 * 2 * 2,
        overhead_bytes=512 * 15 * 2,
        budget_blocks=9,
        num_seqs_fit=4,
    )


def test_a_tied_lm_head_is_counted_once() -> None:
    shapes = [("model.embed_tokens.weight", (10, 4)), ("lm_head.weight", (10, 4))]
    assert count_parameters(shapes, tie_word_embeddings=True).total == 40
    assert count_parameters(shapes, tie_word_embeddings=False).total == 80


def model_config(*, layers: int, kv_heads: int, head_dim: int) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=32,
        hidden_size=kv_heads * head_dim,
        intermediate_size=8,
        num_layers=layers,
        num_heads=kv_heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=64,
    )


@pytest.mark.slow
def test_smollm2_135m_has_135m_parameters_and_its_kv_per_token() -> None:
    from engine.model_dirs.fetch import FetchError, resolve_model

    try:
        resolve_model("smollm2-135m-instruct")
    except FetchError as exc:
        pytest.skip(f"smollm2-135m-instruct cannot be fetched: {exc}")
    report = inspect_json("smollm2-135m-instruct", "--kv-dtype", "float32")
    assert 134_000_000 <= report["params"]["total"] <= 136_000_000
    assert report["kv"]["bytes_per_token"] == 2 * 30 * 3 * 64 * 4
