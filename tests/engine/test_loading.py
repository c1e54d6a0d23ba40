from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from engine.config import model_config_from_hf
from engine.errors import ModelLoadError, UnsupportedModelError
from engine.llm_engine import LLMEngine
from engine.loader import load_model_config
from engine.model_dirs.tiny import init_tiny_model, train_tokenizer
from engine.model_files import model_fingerprint


def edit_config(model_dir: Path, **changes: object) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.fixture
def model_copy(tiny_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_dir, tmp_path / "copy"))


def test_tiny_model_config_matches_tokenizer(tiny_dir: Path) -> None:
    engine = LLMEngine.from_model_dir(tiny_dir)
    assert engine.model_config.vocab_size == engine.tokenizer.vocab_size == 512
    assert engine.model_config.architecture == "LlamaForCausalLM"
    assert engine.tokenizer.eos_token_ids == (1,)


def test_tokenizer_training_is_fast() -> None:
    start = time.perf_counter()
    tokenizer = train_tokenizer(1024)
    assert time.perf_counter() - start < 2.0
    assert tokenizer.get_vocab_size() == 1024


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ],
)
def test_unsupported_configs_name_the_problem(
    model_copy: Path, changes: dict[str, object], message: str
) -> None:
    edit_config(model_copy, **changes)
    with pytest.raises(UnsupportedModelError, match=message):
        LLMEngine.from_model_dir(model_copy)


@pytest.mark.parametrize("missing", ["config.json", "tokenizer.json", "model.safetensors"])
def test_missing_files_name_the_file(model_copy: Path, missing: str) -> None:
    (model_copy / missing).unlink()
    with pytest.raises(
        ModelLoadError, match="safetensors" if missing.endswith("safetensors") else missing
    ):
        LLMEngine.from_model_dir(model_copy)


def test_missing_shard_is_named(tmp_path: Path) -> None:
    model_dir = init_tiny_model(tmp_path / "sharded", num_shards=2)
    (model_dir / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model-00002-of-00002"):
        LLMEngine.from_model_dir(model_dir)


def test_shape_mismatch_is_reported(model_copy: Path) -> None:
    edit_config(model_copy, intermediate_size=200)
    with pytest.raises(ModelLoadError, match="shape"):
        LLMEngine.from_model_dir(model_copy)


def test_mistral_sliding_window_caps_the_context() -> None:
    raw = {
        "architectures": ["MistralForCausalLM"],
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 1,
        "intermediate_size": 128,
        "vocab_size": 10,
        "max_position_embeddings": 32768,
        "sliding_window": 4096,
    }
    assert model_config_from_hf(raw).max_position_embeddings == 4096


def test_qwen2_gets_qkv_bias_without_output_bias(tmp_path: Path) -> None:
    config = load_model_config(init_tiny_model(tmp_path / "q", architecture="qwen2"))
    assert config.qkv_bias and not config.o_bias


def test_fingerprint_tracks_weights(tiny_dir: Path, tmp_path: Path) -> None:
    assert model_fingerprint(tiny_dir) == model_fingerprint(tiny_dir)
    other = init_tiny_model(tmp_path / "other", seed=5)
    assert model_fingerprint(other) != model_fingerprint(tiny_dir)


def test_chat_template_and_bos_token(tiny_dir: Path) -> None:
    tokenizer = LLMEngine.from_model_dir(
        tiny_dir,
    ).tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "café?"}]
    text = tokenizer.apply_chat_template(messages)
    assert text == "<s><|system|>\nBe brief.</s>\n<|user|>\ncafé?</s>\n<|assistant|>\n"
    ids = tokenizer.encode_chat(messages)
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.decode(ids) == "\nBe brief.\n\ncafé?\n\n"
    assert tokenizer.encode("hi")[0] == tokenizer.bos_token_id
