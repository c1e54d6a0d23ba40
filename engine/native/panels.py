"""The packed weights the native matrix multiply reads: panels of `PANEL_WIDTH` output
features, float32 or int8, or uint8 integer panels for the CPU's integer dot products."""

from __future__ import annotations

import torch

# Output features per panel of a packed weight (NR in simd.h).
PANEL_WIDTH = 16
# Depths per group of the integer panels (`vpdpbusd` multiplies 4 bytes per output), and
# per scale of the activations they multiply: their depth is a multiple of the latter.
GROUP_DEPTH = 4
ACTIVATION_BLOCK = 32


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> panels [ceil(N / 16), K, 16] for `gemm`: panels[p, k, j] = W[16p + j, k],
    rows past N zero."""
    out_features, in_features = weight.shape
    num_panels = -(-out_features // PANEL_WIDTH)
    padded = weight.new_zeros(num_panels * PANEL_WIDTH, in_features)
    padded[:out_features] = weight
    return padded.view(num_panels, PANEL_WIDTH, in_features).transpose(1, 2).contiguous()


def pack_integer_panels(rows: torch.Tensor) -> torch.Tensor:
    """int8 rows [N, K] (K a multiple of 32) -> uint8 panels [ceil(N / 16), K / 4, 16, 4] for
    `gemm` with integer dot products: panels[p, g, j, i] = rows[16p + j, 4g + i] + 128, rows
    past N zero (128)."""
    out_features, in_features = rows.shape
    if in_features % ACTIVATION_BLOCK:
        raise ValueError(f"integer panels need a depth that is a multiple of {ACTIVATION_BLOCK}")
    num_panels = -(-out_features // PANEL_WIDTH)
    padded = torch.full((num_panels * PANEL_WIDTH, in_features), 128, dtype=torch.uint8)
    padded[:out_features] = (rows.to(torch.int16) + 128).to(torch.uint8)
    grouped = padded.view(num_panels, PANEL_WIDTH, in_features // GROUP_DEPTH, GROUP_DEPTH)
    return grouped.transpose(1, 2).contiguous()


def panel_rows(panels: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The rows of W with indices `rows` [n], read out of its panels: [n, K], in the panels'
    element type, int8 for integer panels (`pack_panels`, `pack_integer_panels`)."""
    if panels.dtype != torch.uint8:
        return panels[rows // PANEL_WIDTH, :, rows % PANEL_WIDTH]
    picked = panels[rows // PANEL_WIDTH, :, rows % PANEL_WIDTH, :]  # [n, K / 4, 4]
    return (picked.reshape(len(rows), -1).to(torch.int16) - 128).to(torch.int8)
