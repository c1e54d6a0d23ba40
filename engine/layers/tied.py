"""A tied embedding and LM head held once, in the layout the LM head's multiply reads.

A model whose LM head shares the embedding's vocabulary x hidden matrix multiplies by it
once per sampled row, the largest single product of a decode step on a model with a large
vocabulary. `tie_into_panels` replaces both modules by views of one `TiedPanels`: the
matrix as panels of 16 rows for the native `gemm` kernel (fp32, or int8 with one scale
per row when the model's linear layers are int8, in the layout `pack_int8` picks), from
which the embedding reads a token's row. The matrix exists once either way, in int8 at a
quarter of its fp32 bytes.
"""

from __future__ import annotations

import torch
from torch import nn

from engine import native
from engine.layers.linear import Embedding, Linear
from engine.layers.quantized import pack_int8, quantize_rows


class TiedPanels(nn.Module):
    """The shared [vocab, hidden] matrix as panels, with a scale per row when int8."""

    def __init__(self, weight: torch.Tensor, kernels: native.Kernels, int8: bool) -> None:
        super().__init__()
        self.vocab_size = weight.shape[0]
        self.gemm = kernels.gemm
        self.panels: torch.Tensor
        self.scale: torch.Tensor | None
        if int8:
            rows, scale = quantize_rows(weight.detach())
            self.register_buffer("panels", pack_int8(rows, kernels))
            self.register_buffer("scale", scale)
        else:
            self.register_buffer("panels", native.pack_panels(weight.detach()))
            self.scale = None

    def rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids: [T] -> their rows of the matrix, [T, hidden] in fp32."""
        picked = native.panel_rows(self.panels, token_ids)
        if self.scale is None:
            return picked
        return picked.float().mul_(self.scale[token_ids].unsqueeze(1))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> [N, vocab]."""
        return self.gemm(hidden, self.panels, None, self.vocab_size, self.scale)


class TiedEmbedding(nn.Module):
    def __init__(self, tied: TiedPanels) -> None:
        super().__init__()
        self.tied = tied

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.tied.rows(token_ids)


class TiedHead(nn.Module):
    def __init__(self, tied: TiedPanels) -> None:
        super().__init__()
        self.tied = tied

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tied.logits(hidden)


def tie_into_panels(model: nn.Module, *, int8: bool) -> bool:
    """Replace a Llama model's tied `embed_tokens` and `lm_head` by views of one
    `TiedPanels` (int8 with `int8`); False, the model unchanged, when its head is not tied
    to its embedding or the native kernels cannot multiply its weight."""
    decoder = getattr(model, "model", None)
    embedding = getattr(decoder, "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    if not (
        isinstance(embedding, Embedding)
        and isinstance(head, Linear)
        and head.weight is embedding.weight
        and head.bias is None
    ):
        return False
    kernels = native.for_tensors(embedding.weight.detach())
    if kernels is None:
        return False
    tied = TiedPanels(embedding.weight, kernels, int8)
    decoder.embed_tokens = TiedEmbedding(tied)  # type: ignore[union-attr]
    model.lm_head = TiedHead(tied)  # type: ignore[assignment]
    return True
