"""Loading a Hugging Face model directory: config, safetensors weights, tokenizer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ModelConfig, model_config_from_hf
from engine.errors import ModelLoadError, UnsupportedModelError
from engine.model_files import read_json, read_optional_json, require_file, weight_files
from engine.models.llama import LlamaForCausalLM
from engine.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model_config(model_dir: str | Path) -> ModelConfig:
    root = Path(model_dir)
    if not root.is_dir():
        raise ModelLoadError(f"{root}: not a directory")
    return model_config_from_hf(read_json(require_file(root, "config.json")))


def resolve_dtype(name: str, config: ModelConfig) -> torch.dtype:
    """`name` is a dtype name or "auto" for the checkpoint's own `torch_dtype`."""
    key = config.torch_dtype if name == "auto" else name
    if key not in DTYPES:
        raise UnsupportedModelError(
            f"dtype {key!r} is not supported (supported: {', '.join(DTYPES)})"
        )
    return DTYPES[key]


def iter_weights(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every safetensors file of the model."""
    for path in weight_files(Path(model_dir)):
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():
                    yield name, handle.get_tensor(name)
        except (OSError, RuntimeError, ValueError) as exc:
            raise ModelLoadError(f"{path}: cannot read safetensors: {exc}") from exc


def load_model(
    model_dir: str | Path, config: ModelConfig, block_size: int, dtype: torch.dtype
) -> LlamaForCausalLM:
    model = LlamaForCausalLM(config, block_size, dtype)
    model.load_weights(iter_weights(model_dir))
    return model.eval()


def load_tokenizer(model_dir: str | Path, config: ModelConfig) -> Tokenizer:
    """The tokenizer, with EOS ids from config.json and generation_config.json added to its own."""
    generation = read_optional_json(Path(model_dir), "generation_config.json")
    eos = generation.get("eos_token_id")
    extra = [eos] if isinstance(eos, int) else list(eos or [])
    return Tokenizer.from_model_dir(model_dir, extra_eos_token_ids=[*config.eos_token_ids, *extra])
