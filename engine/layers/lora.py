"""LoRA applied per request in a mixed batch (as S-LoRA and vLLM do): the base layer runs
once over every row, then every resident adapter's term is added in two matmuls, however
many adapters the step holds.

At load, a targeted layer stacks the A of every adapter (and of every projection of a fused
layer) into one [C, in] matrix and the B into one block-diagonal [out, C] matrix: column c
belongs to one adapter's slot. Per step, x @ A^T gives every row every adapter's rank
features [T, C]; a 0/1 mask keeps only the columns of the row's own slot, and that times
B^T is each row's own delta. Rows of the base model (slot 0) own no column, so theirs is
exactly zero and a request for the base model computes what it would with no adapter.
Python loops run at load, never per step, and the step's work grows with the total rank
of the resident adapters, which `EngineConfig.adapters` bounds.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from engine.adapters import LoraAdapter

# (adapter slot, first output row, A [r, in], B [out, r] scaled)
Part = tuple[int, int, torch.Tensor, torch.Tensor]


class LoraBatch:
    """Each row's adapter slot in the current step; shared by every LoRA layer.

    Slot 0 is the base model. The last decoder layer sees only the rows that sample
    (`keep`) after its attention, so both row sets are kept; a layer tells them apart by
    its input's row count. Layers whose columns belong to the same slots share a layout,
    and so the step's mask for it.
    """

    def __init__(self) -> None:
        self._all: torch.Tensor | None = None
        self._kept: torch.Tensor | None = None
        self._layouts: dict[tuple[int, ...], int] = {}
        self._columns: list[torch.Tensor] = []  # per layout: [C] the slot of each column
        self._masks: dict[tuple[int, int], torch.Tensor] = {}

    def set_step(self, slots: torch.Tensor | None, keep: torch.Tensor | None) -> None:
        """slots: [T] adapter slot of each row (None: every row is the base model's)."""
        self._masks.clear()
        self._all = slots
        self._kept = slots if slots is None or keep is None else slots.index_select(0, keep)

    def layout(self, column_slots: Sequence[int], device: torch.device) -> int:
        """The layout id of a layer whose column c belongs to `column_slots[c]`."""
        key = tuple(column_slots)
        if key not in self._layouts:
            self._layouts[key] = len(self._columns)
            self._columns.append(torch.tensor(key, device=device))
        return self._layouts[key]

    def mask(self, layout: int, num_rows: int, dtype: torch.dtype) -> torch.Tensor | None:
        """[T, C] 1 where the row's slot owns the column; None when every row is the base's."""
        slots = (
            self._all if self._all is not None and num_rows == self._all.shape[0] else self._kept
        )
        if slots is None:
            return None
        key = (layout, num_rows)
        if key not in self._masks:
            columns = self._columns[layout]
            rows = slots.to(columns.device)
            self._masks[key] = (rows.unsqueeze(1) == columns.unsqueeze(0)).to(dtype)
        return self._masks[key]


class LoraLinear(nn.Module):
    """A linear layer (plain, packed or quantized) plus the stacked adapters that target it."""

    def __init__(self, base: nn.Module, batch: LoraBatch, parts: Sequence[Part]) -> None:
        super().__init__()
        self.base = base
        self.batch = batch
        self.first_row = min(offset for _, offset, _, b in parts)
        end = max(offset + b.shape[0] for _, offset, _, b in parts)
        self.a = torch.cat([a for _, _, a, _ in parts])  # [C, in]
        self.b = self.a.new_zeros(end - self.first_row, self.a.shape[0])  # [out, C]
        column = 0
        for _, offset, a, b in parts:
            rows = self.b.narrow(0, offset - self.first_row, b.shape[0])
            rows.narrow(1, column, a.shape[0]).copy_(b)
            column += a.shape[0]
        column_slots = [slot for slot, _, a, _ in parts for _ in range(a.shape[0])]
        self.layout = batch.layout(column_slots, self.a.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in] -> [T, out]."""
        out = self.base(x)
        mask = self.batch.mask(self.layout, x.shape[0], x.dtype)
        if mask is None:
            return out
        features = torch.mm(x, self.a.t()).mul_(mask)  # [T, C]: each row's own slot only
        target = out
        if self.first_row != 0 or self.b.shape[0] != out.shape[1]:
            target = out.narrow(1, self.first_row, self.b.shape[0])
        target.addmm_(features, self.b.t())
        return out


def attach_adapters(model: nn.Module, adapters: Sequence[LoraAdapter]) -> LoraBatch:
    """Wrap every layer an adapter targets in a `LoraLinear`; adapter i gets slot i + 1.
    Call after the layers are quantized and packed: the wrapper takes them as they are."""
    batch = LoraBatch()
    parts: dict[str, list[Part]] = {}
    for slot, adapter in enumerate(adapters, start=1):
        for layer, deltas in adapter.deltas.items():
            parts.setdefault(layer, []).extend((slot, d.offset, d.a, d.b) for d in deltas)
    for layer, layer_parts in parts.items():
        _wrap(model, layer, batch, layer_parts)
    return batch


def _wrap(model: nn.Module, name: str, batch: LoraBatch, parts: Sequence[Part]) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, LoraLinear(getattr(parent, child), batch, parts))
