"""Int8 weight-only quantization of linear layers, one scale per output channel.

A forward pass dequantizes the int8 weight a chunk of rows at a time into one buffer
shared by all layers, small enough to stay in cache: the full-precision weight never
exists in memory again, and activations keep the model's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import Linear, replace_linear_layers, shared_weights

# 4 MiB of fp32 per chunk: fewer, larger chunks cost Python overhead less but fall out of cache.
_CHUNK_ELEMENTS = 1 << 20
_QMAX = 127


class DequantBuffer:
    """The scratch matrix a chunk of int8 rows is widened into; reused by every layer."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._buffer = torch.empty(0, dtype=dtype)

    def widen(self, rows: torch.Tensor) -> torch.Tensor:
        """rows: int8 [n, k] -> the same values as [n, k] in the buffer's dtype."""
        if self._buffer.numel() < rows.numel():
            self._buffer = torch.empty(rows.numel(), dtype=self.dtype)
        return self._buffer[: rows.numel()].view(rows.shape).copy_(rows)


class Int8Linear(nn.Module):
    """`Linear` with its weight stored as int8 rows times an fp32 scale per row."""

    def __init__(self, linear: Linear, buffer: DequantBuffer) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        # Symmetric per row; an all-zero row keeps a scale of 1 instead of dividing by 0.
        scale = weight.abs().amax(dim=1) / _QMAX
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        qweight = torch.round(weight / scale.unsqueeze(1)).clamp_(-_QMAX, _QMAX)
        self.qweight: torch.Tensor
        self.scale: torch.Tensor
        self.register_buffer("qweight", qweight.to(torch.int8))
        self.register_buffer("scale", scale)
        self.bias = linear.bias
        self.buffer = buffer
        self.rows_per_chunk = max(1, _CHUNK_ELEMENTS // weight.shape[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in] -> [T, out]."""
        n = self.qweight.shape[0]
        if self.rows_per_chunk >= n:
            out = F.linear(x, self.buffer.widen(self.qweight))
        else:
            out = x.new_empty(x.shape[0], n)
            for start in range(0, n, self.rows_per_chunk):
                rows = self.qweight[start : start + self.rows_per_chunk]
                torch.mm(x, self.buffer.widen(rows).T, out=out[:, start : start + rows.shape[0]])
        # x @ (q * s)^T == (x @ q^T) * s: scaling the output is cheaper than each chunk.
        out.mul_(self.scale)
        return out if self.bias is None else out.add_(self.bias)


def quantize_int8(model: nn.Module) -> int:
    """Replace the model's `Linear` layers by `Int8Linear` in place; return how many.

    A layer whose weight another module shares (an LM head tied to the embedding)
    stays as it is: quantizing it would add a copy instead of saving memory.
    """
    dtype = next(model.parameters()).dtype
    buffer = DequantBuffer(dtype)
    shared = shared_weights(model)
    return replace_linear_layers(
        model,
        lambda linear: id(linear.weight) not in shared,
        lambda linear: Int8Linear(linear, buffer),
    )
