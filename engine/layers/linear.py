"""Linear and embedding layers that leave their parameters uninitialised: every value
comes from a checkpoint, so random initialisation would only cost start-up time.

`pack_linear_layers` then reorders each fp32 linear layer's weight once into the layout
its matrix multiply reads: panels for the native kernel (`PanelLinear`), or, where native
kernels are unavailable, oneDNN's blocked layout (`PackedLinear`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine import native

# Where a weight is not packed (`PanelLinear`, `PackedLinear`), W @ x^T streams it row by
# row; its result is x @ W^T laid out transposed. With few rows that is the cheaper
# product. With many, the transposed result costs more in the operations that follow (and
# sends attention down a slower path) than it saves, except for a weight this large (an LM
# head over a large vocabulary), which only ever sees the rows that sample.
# `python -m bench.linear` measures both ways by row count (bench/RESULTS.md).
_STREAMED_MAX_ROWS = 64
_STREAMED_WEIGHT_ELEMENTS = 1 << 23


class Linear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
            if bias
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and (
            x.shape[0] <= _STREAMED_MAX_ROWS or self.weight.numel() >= _STREAMED_WEIGHT_ELEMENTS
        ):
            out = torch.mm(self.weight, x.t()).t()
            return out if self.bias is None else out + self.bias
        return F.linear(x, self.weight, self.bias)


class PanelLinear(nn.Module):
    """`Linear` with its weight held in panels of 16 output features, multiplied by the
    native `gemm` kernel.

    `python -m bench.linear` measures it against `PackedLinear` and both ways `Linear`
    multiplies (bench/RESULTS.md).
    """

    def __init__(self, linear: Linear, gemm: native.GemmKernel) -> None:
        super().__init__()
        self.out_features = linear.weight.shape[0]
        # A buffer, so that the model's size counts it; not saved (its layout is our own).
        self.panels: torch.Tensor
        self.register_buffer("panels", native.pack_panels(linear.weight.detach()), persistent=False)
        self.bias = linear.bias
        self.gemm = gemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        return self.gemm(rows, self.panels, self.bias, self.out_features).view(
            *x.shape[:-1], self.out_features
        )


class PackedLinear(nn.Module):
    """`Linear` with its weight held in oneDNN's blocked layout (an opaque tensor)."""

    def __init__(self, linear: Linear) -> None:
        super().__init__()
        # A buffer, so that the model's size counts it; not saved (its layout is opaque).
        self.packed: torch.Tensor
        self.register_buffer("packed", pack_weight(linear.weight.detach()), persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias)


def can_pack(weight: torch.Tensor) -> bool:
    """Whether this build of PyTorch multiplies `weight` through oneDNN with it prepacked."""
    return (
        weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] -> the same values reordered for `packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight)


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ W^T + bias, for W packed by `pack_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_linear_layers(model: nn.Module) -> int:
    """Replace the model's fp32 CPU `Linear` layers in place by `PanelLinear`, or by
    `PackedLinear` where native kernels are unavailable; return how many.

    A layer whose weight another module shares (an LM head tied to the embedding) stays as
    it is: packing it would add a copy of vocabulary x hidden elements.
    """
    shared = shared_weights(model)
    gemm = native.gemm()
    if gemm is not None:
        return replace_linear_layers(
            model,
            lambda linear: (
                native.for_tensors(linear.weight.detach()) is not None
                and id(linear.weight) not in shared
            ),
            lambda linear: PanelLinear(linear, gemm),
        )
    return replace_linear_layers(
        model,
        lambda linear: can_pack(linear.weight) and id(linear.weight) not in shared,
        PackedLinear,
    )


def shared_weights(model: nn.Module) -> set[int]:
    """Ids of the parameters that modules other than `Linear` layers hold (a tied embedding)."""
    return {
        id(param)
        for module in model.modules()
        if not isinstance(module, Linear)
        for param in module.parameters(recurse=False)
    }


def replace_linear_layers(
    model: nn.Module,
    select: Callable[[Linear], bool],
    replacement: Callable[[Linear], nn.Module],
) -> int:
    """Replace each selected `Linear` of the model by `replacement(linear)`; return how many."""
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, Linear) and select(module)
    ]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, replacement(module))
    return len(targets)


class Embedding(nn.Module):
    def __init__(
        self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(num_embeddings, embedding_dim, dtype=dtype), requires_grad=False
        )

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.weight)
