"""Int8 quantization of linear layers: weights with one scale per output channel.

With the native kernels and fp32 activations, the int8 weight is packed in panels for
the `gemm` kernel: where the CPU has integer dot products, as integer panels that it
multiplies by the activations quantized to 8 bits on the way in (one scale per block of
32 of a row's values, as llama.cpp's 8-bit formats do); elsewhere as int8 panels that it
widens in registers. Otherwise a forward pass dequantizes it a
chunk of rows at a time into one buffer shared by all layers, small enough to stay in
cache. Either way the full-precision weight never exists in memory again, and
activations keep the model's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine import native
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


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> int8 rows [N, K] and an fp32 scale per row, symmetric: row i is
    about rows[i] * scale[i]. An all-zero row keeps a scale of 1 instead of dividing by 0."""
    weight = weight.float()
    scale = weight.abs().amax(dim=1) / _QMAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    rows = torch.round(weight / scale.unsqueeze(1)).clamp_(-_QMAX, _QMAX).to(torch.int8)
    return rows, scale


def pack_int8(rows: torch.Tensor, kernels: native.Kernels | None) -> torch.Tensor:
    """int8 rows [N, K] as `kernels.gemm` multiplies them best: integer panels where the
    CPU has integer dot products (and K is a multiple of their activations' block), int8
    panels otherwise; the rows themselves without native kernels."""
    if kernels is None:
        return rows
    if kernels.integer_panels and rows.shape[1] % native.ACTIVATION_BLOCK == 0:
        return native.pack_integer_panels(rows)
    return native.pack_panels(rows)


class Int8Linear(nn.Module):
    """`Linear` with its weight stored as int8 rows times an fp32 scale per row."""

    def __init__(self, linear: Linear, buffer: DequantBuffer) -> None:
        super().__init__()
        qweight, scale = quantize_rows(linear.weight.detach())
        out_features, in_features = qweight.shape
        self.out_features = out_features
        kernels = native.for_tensors(linear.weight.detach())
        self.gemm = kernels.gemm if kernels else None
        # One layout or another: [out, in] rows, or panels for the native kernel.
        self.qweight: torch.Tensor
        self.scale: torch.Tensor
        self.register_buffer("qweight", pack_int8(qweight, kernels))
        self.register_buffer("scale", scale)
        self.bias = linear.bias
        self.buffer = buffer
        self.rows_per_chunk = max(1, _CHUNK_ELEMENTS // in_features)

    def int8_rows(self) -> torch.Tensor:
        """The int8 weight as [out, in] rows, whatever the layout it is held in."""
        if self.qweight.dim() == 2:
            return self.qweight
        return native.panel_rows(self.qweight, torch.arange(self.out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in] -> [T, out]."""
        if self.gemm is not None and x.dtype == torch.float32:
            return self.gemm(x, self.qweight, self.bias, self.out_features, self.scale)
        n = self.out_features
        qweight = self.int8_rows()
        if self.rows_per_chunk >= n:
            out = F.linear(x, self.buffer.widen(qweight))
        else:
            out = x.new_empty(x.shape[0], n)
            for start in range(0, n, self.rows_per_chunk):
                rows = qweight[start : start + self.rows_per_chunk]
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
