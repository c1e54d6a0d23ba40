"""Linear and embedding layers that leave their parameters uninitialised: every value
comes from a checkpoint, so random initialisation would only cost start-up time."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# W @ x^T streams the weight row by row; its result is x @ W^T laid out transposed.
# `python -m bench.linear` measures it 1.2-2.8x faster than x @ W^T for 4-64 rows of the
# benchmark model's projections. With more rows a transposed result costs more in the
# operations that follow (and sends attention down a slower path) than it saves, except
# for a weight this large (an LM head over a large vocabulary), which only ever sees the
# rows that sample.
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
