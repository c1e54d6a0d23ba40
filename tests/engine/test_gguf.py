"""A GGUF file converted to a Hugging Face directory is the model it was made from."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tokenizers
import torch
from gguf import GGUFWriter

from engine.errors import ModelLoadError
from engine.gguf import convert, unpermute_rotary
from engine.loader import load_model, load_model_config, load_tokenizer
from tests.engine.gguf_files import llama_cpp_permute, write_gguf
from tests.engine.helpers import paged_logits

TEXTS = ["hello world", "The 12 cats sat, 345 times!", "  two  spaces\nand a line", "é ü 日本"]


@pytest.mark.parametrize(("rows", "heads"), [(64, 4), (32, 2), (576, 9)])
def test_unpermute_undoes_llama_cpp_row_order(rows: int, heads: int) -> None:
    weight = np.random.default_rng(0).standard_normal((rows, 8)).astype(np.float32)
    assert np.array_equal(unpermute_rotary(llama_cpp_permute(weight, heads), heads), weight)


@pytest.fixture(scope="module")
def converted(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gguf")
    return convert(write_gguf(tiny_model_dir, root / "tiny.gguf"), root / "hf")


def logits_of(model_dir: Path, ids: list[int]) -> torch.Tensor:
    config = load_model_config(model_dir)
    return paged_logits(load_model(model_dir, config, 4, torch.float32), ids, [len(ids)])


def test_the_converted_model_gives_the_original_logits(
    tiny_model_dir: Path, converted: Path
) -> None:
    ids = list(range(3, 40))
    assert torch.equal(logits_of(converted, ids), logits_of(tiny_model_dir, ids))


def test_the_converted_tokenizer_splits_text_as_the_original(
    tiny_model_dir: Path, converted: Path
) -> None:
    original = tokenizers.Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    ours = load_tokenizer(converted, load_model_config(converted))
    for text in TEXTS:
        expected = original.encode(text, add_special_tokens=False).ids
        assert ours.backend.encode(text, add_special_tokens=False).ids == expected
        assert ours.decode(expected) == text
    assert ours.eos_token_ids == (1,)
    assert ours.chat_template is not None and "messages" in ours.chat_template


def test_quantized_weights_are_dequantized_within_their_step(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    model_dir = convert(write_gguf(tiny_model_dir, tmp_path / "q8.gguf", quantized=True), tmp_path)
    ids = list(range(3, 30))
    got, expected = logits_of(model_dir, ids), logits_of(tiny_model_dir, ids)
    assert not torch.equal(got, expected)  # Q8_0 rounds the weights...
    assert torch.allclose(got, expected, atol=0.05 * expected.abs().max().item())  # ...a little
    assert got[-1].argmax() == expected[-1].argmax()


def test_another_architecture_is_refused(tmp_path: Path) -> None:
    writer = GGUFWriter(str(tmp_path / "mamba.gguf"), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="architecture 'mamba' is not supported"):
        convert(tmp_path / "mamba.gguf", tmp_path / "out")


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        convert(tmp_path / "x.gguf", tmp_path / "out")
