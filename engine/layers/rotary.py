"""Rotary position embeddings, including Llama 3's frequency scaling."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from engine import native
from engine.config import RopeConfig


def inverse_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """[head_dim // 2] rotation speeds, scaled as `rope.rope_type` asks."""
    # Explicit device: models are built under a meta-device context, these stay real.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scaled(inv_freq, rope)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    original = rope.original_max_position_embeddings
    low_freq_wavelen = original / rope.low_freq_factor
    high_freq_wavelen = original / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (original / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Cos/sin tables, grown on demand, and their application to queries and keys."""

    def __init__(self, head_dim: int, rope: RopeConfig) -> None:
        super().__init__()
        self.head_dim = head_dim
        self._inv_freq = inverse_frequencies(head_dim, rope)
        self._cos = torch.empty(0, head_dim // 2, device="cpu")
        self._sin = torch.empty(0, head_dim // 2, device="cpu")

    def rotation(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotation:
        """What rotates a step's queries and keys, for its `positions` [T]."""
        cos_table, sin_table = self.tables(positions)
        kernels = native.kernels() if dtype == torch.float32 else None
        if kernels is not None:
            return NativeRotation(positions, cos_table, sin_table, kernels.rotary)
        cos = cos_table.index_select(0, positions).to(dtype)
        sin = sin_table.index_select(0, positions).to(dtype)
        return TableRotation(cos.unsqueeze(1), sin.unsqueeze(1))

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos and sin tables [covered, head_dim // 2], float32, grown to cover every
        one of `positions` (non-negative)."""
        needed = int(positions.max()) + 1 if positions.numel() else 0
        if needed > self._cos.shape[0]:
            self._grow(needed)
        return self._cos, self._sin

    def _grow(self, needed: int) -> None:
        size = 1 << max(needed - 1, 1).bit_length()
        steps = torch.arange(size, dtype=torch.int64, device="cpu").float()
        freqs = torch.outer(steps, self._inv_freq)
        self._cos, self._sin = freqs.cos(), freqs.sin()


class Rotation(ABC):
    """Rotates `x` [T, heads, head_dim] by position; halves are paired (not interleaved).
    Returns the rotated values: `x` itself, rotated in place, or a new tensor."""

    __slots__ = ()

    @abstractmethod
    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class TableRotation(Rotation):
    cos: torch.Tensor  # [T, 1, head_dim // 2], one row per position of the step
    sin: torch.Tensor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * self.cos - x2 * self.sin, x2 * self.cos + x1 * self.sin), dim=-1)


@dataclass(frozen=True, slots=True)
class NativeRotation(Rotation):
    positions: torch.Tensor  # [T]
    cos: torch.Tensor  # [positions covered, head_dim // 2], the whole table
    sin: torch.Tensor
    kernel: native.RotaryKernel

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
            x = x.contiguous()  # laid out transposed (see linear.py): rotate a copy
        self.kernel(x, self.positions, self.cos, self.sin)
        return x
