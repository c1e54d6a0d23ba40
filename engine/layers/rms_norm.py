"""Root-mean-square layer norm."""

from __future__ import annotations

import torch
from torch import nn

from engine import native


class RMSNorm(nn.Module):
    def __init__(
        self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual_delta: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, hidden] -> normalised x. With `residual_delta`, x += residual_delta first,
        in place (x is the residual stream)."""
        kernels = native.for_tensors(x, residual_delta, self.weight) if x.dim() == 2 else None
        if kernels is not None:
            return kernels.rms_norm(x, self.weight, self.eps, residual_delta)
        if residual_delta is not None:
            x += residual_delta
        if x.dtype == torch.float32:
            return torch.nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in fp32 and round before the weight, as the reference implementation does.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)
