"""Random PEFT-format LoRA adapters for a base model: the adapters of the tests, the
benchmarks and `tollgate models adapter-init`."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.adapters import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    ATTENTION_MODULES,
    TARGET_MODULES,
    projection_shapes,
)
from engine.loader import load_model_config

# B's spread relative to the base weights' (about in**-0.5): large enough that every
# adapter visibly changes the logits, small enough to leave the model coherent.
_B_STD = 0.5


def init_adapter(
    directory: str | Path,
    base_dir: str | Path,
    *,
    rank: int = 8,
    alpha: float | None = None,
    seed: int = 0,
    target_modules: Sequence[str] = TARGET_MODULES,
) -> Path:
    """Write `adapter_config.json` and `adapter_model.safetensors` for the model at
    `base_dir`; `alpha` defaults to 2 * rank. Returns the directory."""
    if rank <= 0:
        raise ValueError(f"rank must be positive, not {rank}")
    unknown = sorted(set(target_modules) - set(TARGET_MODULES))
    if unknown or not target_modules:
        raise ValueError(f"target modules must be among {', '.join(TARGET_MODULES)}")
    cfg = load_model_config(base_dir)
    shapes = projection_shapes(cfg)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(cfg.num_layers):
        for module in target_modules:
            out, in_features = shapes[module]
            group = "self_attn" if module in ATTENTION_MODULES else "mlp"
            key = f"base_model.model.model.layers.{layer}.{group}.{module}"
            a = torch.randn(rank, in_features, generator=gen) * in_features**-0.5
            b = torch.randn(out, rank, generator=gen) * (_B_STD * rank**-0.5 * in_features**-0.5)
            tensors[f"{key}.lora_A.weight"] = a.contiguous()
            tensors[f"{key}.lora_B.weight"] = b.contiguous()
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(root / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(Path(base_dir).resolve()),
        "r": rank,
        "lora_alpha": alpha if alpha is not None else 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": sorted(target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    (root / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return root
