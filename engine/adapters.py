"""PEFT-format LoRA adapters: reading `adapter_config.json` + `adapter_model.safetensors`
for a base model, their fingerprint, and merging one into the base weights.

An adapter changes a targeted projection W [out, in] to W + (alpha / r) * B @ A, with
A [r, in] and B [out, r]. The engine applies it per request (`engine.layers.lora`);
`merge_adapter` folds it into the weights instead, for a model that serves one adapter
alone.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.errors import ModelLoadError, UnsupportedModelError
from engine.model_files import fingerprint_text, read_json, require_file
from engine.models.llama import LlamaForCausalLM, fused_target

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = (*ATTENTION_MODULES, *MLP_MODULES)
# PEFT's prefix of every saved tensor name: its wrapper around the base model.
_PEFT_PREFIX = "base_model.model."
_LORA_KEY = re.compile(r"(?P<module>.+\.(?P<leaf>\w+))\.lora_(?P<half>[AB])\.weight")
# Options that change what the adapter computes beyond W + scale * B @ A.
_UNSUPPORTED_OPTIONS = ("use_dora", "modules_to_save", "rank_pattern", "alpha_pattern")


@dataclass(frozen=True, slots=True)
class LoraDelta:
    """One targeted projection: rows [offset, offset + out) of a (possibly fused) layer."""

    offset: int
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r], scaled by alpha / r


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    name: str
    rank: int
    alpha: float
    fingerprint: str
    target_modules: tuple[str, ...]  # checkpoint names: "q_proj", "down_proj", ...
    # the engine's layer name (fused: "model.layers.0.self_attn.qkv_proj") -> its deltas
    deltas: Mapping[str, tuple[LoraDelta, ...]]


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection a LoRA adapter may target, by its checkpoint name."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    return {
        "q_proj": (q, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "o_proj": (hidden, q),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }


def adapter_fingerprint(directory: Path) -> str:
    """The identity of an adapter: its whole config and weights (adapters are small)."""
    return fingerprint_text(
        require_file(directory, ADAPTER_CONFIG).read_bytes(),
        require_file(directory, ADAPTER_WEIGHTS).read_bytes(),
    )


def read_adapter_config(directory: Path) -> dict[str, Any]:
    """`adapter_config.json`, checked to describe a LoRA adapter this engine can apply."""
    if not directory.is_dir():
        raise ModelLoadError(f"{directory}: not a directory")
    raw = read_json(require_file(directory, ADAPTER_CONFIG))
    if raw.get("peft_type", "LORA") != "LORA":
        raise UnsupportedModelError(f"{directory}: peft_type {raw.get('peft_type')!r} is not LORA")
    if raw.get("bias", "none") != "none":
        raise UnsupportedModelError(f"{directory}: bias {raw.get('bias')!r} is not supported")
    if raw.get("fan_in_fan_out"):
        raise UnsupportedModelError(f"{directory}: fan_in_fan_out is not supported")
    for option in _UNSUPPORTED_OPTIONS:
        if raw.get(option):
            raise UnsupportedModelError(f"{directory}: {option} is not supported")
    if not isinstance(raw.get("r"), int) or raw["r"] <= 0:
        raise ModelLoadError(f"{directory}: {ADAPTER_CONFIG} needs a positive integer 'r'")
    return raw


def load_adapter(name: str, directory: str | Path, model: LlamaForCausalLM) -> LoraAdapter:
    """The adapter at `directory`, checked against `model`'s shapes; raises ModelLoadError."""
    root = Path(directory)
    raw = read_adapter_config(root)
    rank = int(raw["r"])
    alpha = float(raw.get("lora_alpha", rank))
    scale = alpha / (math.sqrt(rank) if raw.get("use_rslora") else rank)
    halves = _read_halves(root)
    dtype = next(model.parameters()).dtype
    params = {name for name, _ in model.named_parameters()}
    deltas: dict[str, list[LoraDelta]] = {}
    for module, (a, b) in sorted(halves.items()):
        target, shard = fused_target(f"{module}.weight")
        if target not in params:
            raise ModelLoadError(f"adapter targets {module!r}, which the base model lacks")
        _check_shapes(model.config, module, a, b)
        layer = target.removesuffix(".weight")
        offset = 0 if shard is None else sum(model.shard_sizes(target)[:shard])
        deltas.setdefault(layer, []).append(
            LoraDelta(offset, a.to(dtype).contiguous(), (b.float() * scale).to(dtype).contiguous())
        )
    return LoraAdapter(
        name=name,
        rank=rank,
        alpha=alpha,
        fingerprint=adapter_fingerprint(root),
        target_modules=tuple(sorted({_leaf(module) for module in halves})),
        deltas={layer: tuple(parts) for layer, parts in deltas.items()},
    )


def _read_halves(root: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module name (as in the base checkpoint) -> (lora_A, lora_B)."""
    path = require_file(root, ADAPTER_WEIGHTS)
    found: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                match = _LORA_KEY.fullmatch(key.removeprefix(_PEFT_PREFIX))
                if match is None or match["leaf"] not in TARGET_MODULES:
                    raise UnsupportedModelError(f"{path}: unsupported adapter tensor {key!r}")
                found.setdefault(match["module"], {})[match["half"]] = handle.get_tensor(key)
    except (OSError, RuntimeError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot read safetensors: {exc}") from exc
    if not found:
        raise ModelLoadError(f"{path}: no LoRA tensors")
    incomplete = sorted(module for module, pair in found.items() if len(pair) != 2)
    if incomplete:
        raise ModelLoadError(f"{path}: {incomplete[0]} lacks lora_A or lora_B")
    return {module: (pair["A"], pair["B"]) for module, pair in found.items()}


def _check_shapes(cfg: ModelConfig, module: str, a: torch.Tensor, b: torch.Tensor) -> None:
    out, in_features = projection_shapes(cfg)[_leaf(module)]
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
        raise ModelLoadError(f"adapter weights of {module!r} are not a rank-r pair")
    if (a.shape[1], b.shape[0]) != (in_features, out):
        raise ModelLoadError(
            f"adapter weights of {module!r} are [{b.shape[0]}, r] x [r, {a.shape[1]}]; "
            f"the base model's projection is [{out}, {in_features}]: not this base model"
        )


def merge_adapter(model: LlamaForCausalLM, adapter: LoraAdapter) -> None:
    """Adds the adapter's B @ A into the model's weights, in place. Call before the layers
    are quantized or packed: those no longer hold an fp weight to add to."""
    params = dict(model.named_parameters())
    for layer, deltas in adapter.deltas.items():
        weight = params[f"{layer}.weight"].data
        for delta in deltas:
            rows = weight.narrow(0, delta.offset, delta.b.shape[0])
            rows.add_((delta.b.float() @ delta.a.float()).to(weight.dtype))


def _leaf(module: str) -> str:
    return module.rpartition(".")[2]
