"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) over a flat batch of tokens.

Every linear layer sees all tokens of a step packed as [T, hidden]; only attention
looks at sequence boundaries, through the paged KV cache.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine import native
from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.layers.linear import Embedding, Linear
from engine.layers.paged_attention import AttentionMetadata, PagedAttention
from engine.layers.rms_norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, Rotation

# Checkpoint projections stored here as slices of one fused matrix: name -> (fused name, slice).
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.sizes = [
            cfg.num_heads * cfg.head_dim,
            cfg.num_kv_heads * cfg.head_dim,
            cfg.num_kv_heads * cfg.head_dim,
        ]
        self.qkv_proj = Linear(cfg.hidden_size, sum(self.sizes), bias=cfg.qkv_bias, dtype=dtype)
        self.o_proj = Linear(self.sizes[0], cfg.hidden_size, bias=cfg.o_bias, dtype=dtype)
        self.attn = PagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, block_size)

    def forward(
        self,
        x: torch.Tensor,
        rotation: Rotation,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        tokens, heads = x.shape[0], self.num_heads
        qkv = self.qkv_proj(x)
        # Queries and keys sit side by side in qkv: rotate them in one pass.
        qk_width = self.sizes[0] + self.sizes[1]
        qk = rotation(qkv[:, :qk_width].view(tokens, -1, self.head_dim))
        v = qkv[:, qk_width:].view(tokens, self.num_kv_heads, self.head_dim)
        out = self.attn(qk[:, :heads], qk[:, heads:], v, kv_cache, meta)
        return self.o_proj(out if keep is None else out.index_select(0, keep))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = Linear(
            cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias, dtype=dtype
        )
        self.down_proj = Linear(
            cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias, dtype=dtype
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        kernels = native.for_tensors(gate_up)
        if kernels is not None:
            return self.down_proj(kernels.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(cfg, block_size, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(cfg, dtype)

    def forward(
        self,
        x: torch.Tensor,
        rotation: Rotation,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`keep` limits the output to those rows; every row still writes its key and value."""
        attended = self.self_attn(self.input_layernorm(x), rotation, kv_cache, meta, keep)
        # In place: the input of a layer is not needed once its residual is updated.
        x = x if keep is None else x.index_select(0, keep)
        x += self.mlp(self.post_attention_layernorm(x, residual_delta=attended))
        return x


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, block_size, dtype) for _ in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class LlamaForCausalLM(nn.Module):
    """The decoder plus LM head; parameter names follow the checkpoint except for fused projections."""

    def __init__(
        self, cfg: ModelConfig, block_size: int = 16, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, block_size, dtype)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden], or [len(keep), hidden].

        Rows outside `keep` only matter through the keys and values they leave in the
        cache, so the last layer computes its attention output and MLP for `keep` alone.
        """
        x = self.model.embed_tokens(input_ids)
        rotation = self.rotary.rotation(positions, x.dtype)
        last = len(self.model.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
            x = layer(x, rotation, kv_cache, meta, keep if i == last else None)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> fp32 logits [N, vocab]."""
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors in; raise ModelLoadError on unknown, misshapen or missing weights."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq") or (
                name == "lm_head.weight" and self.config.tie_word_embeddings
            ):
                continue
            target, shard = fused_target(name)
            if target not in params:
                raise ModelLoadError(f"unexpected weight {name!r} in checkpoint")
            destination = params[target].data
            if shard is not None:
                sizes = self.shard_sizes(target)
                destination = destination.narrow(0, sum(sizes[:shard]), sizes[shard])
            _copy_into(destination, tensor, name)
            loaded.add(name)
        missing = sorted(_expected_names(params) - loaded)
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ModelLoadError(f"checkpoint lacks {len(missing)} weight(s): {shown}")

    def shard_sizes(self, fused_name: str) -> list[int]:
        cfg = self.config
        if ".qkv_proj." in fused_name:
            kv = cfg.num_kv_heads * cfg.head_dim
            return [cfg.num_heads * cfg.head_dim, kv, kv]
        return [cfg.intermediate_size, cfg.intermediate_size]


def fused_target(name: str) -> tuple[str, int | None]:
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in _FUSED:
            fused, shard = _FUSED[part]
            return ".".join([*parts[:i], fused, *parts[i + 1 :]]), shard
    return name, None


def _expected_names(params: dict[str, nn.Parameter]) -> set[str]:
    """Checkpoint names that must be present, fused parameters split back into their parts."""
    by_fused: dict[str, list[str]] = {}
    for part, (fused, _) in _FUSED.items():
        by_fused.setdefault(fused, []).append(part)
    names: set[str] = set()
    for name in params:
        module, _, leaf = name.rpartition(".")
        prefix, _, last = module.rpartition(".")
        if last in by_fused:
            names.update(f"{prefix}.{part}.{leaf}" for part in by_fused[last])
        else:
            names.add(name)
    return names


def _copy_into(destination: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tuple(destination.shape) != tuple(tensor.shape):
        raise ModelLoadError(
            f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(destination.shape)}"
        )
    destination.copy_(tensor)
