"""LoRA applied per request in a mixed batch (as S-LoRA and vLLM do): the base layer runs
once over every row, then each adapter present in the step adds x @ A^T @ B^T to its own
rows. Rows of the base model get nothing added, so a request for the base model computes
exactly what it would with no adapter loaded.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from engine.adapters import LoraAdapter

# (adapter slot, its rows; None when it has every row of the step)
RowGroups = list[tuple[int, torch.Tensor | None]]


class LoraBatch:
    """Which rows of the current step belong to which adapter; shared by every LoRA layer.

    Slot 0 is the base model. The last decoder layer sees only the rows that sample
    (`keep`) after its attention, so the groups exist for both row sets; a layer tells
    them apart by its input's row count.
    """

    def __init__(self) -> None:
        self._num_rows = 0
        self._all: RowGroups = []
        self._kept: RowGroups = []

    def set_step(self, slots: torch.Tensor | None, keep: torch.Tensor | None) -> None:
        """slots: [T] adapter slot of each row (None: every row is the base model's)."""
        if slots is None:
            self._num_rows, self._all, self._kept = 0, [], []
            return
        self._num_rows = slots.shape[0]
        self._all = _groups(slots)
        self._kept = self._all if keep is None else _groups(slots.index_select(0, keep))

    def groups(self, num_rows: int) -> RowGroups:
        return self._all if num_rows == self._num_rows else self._kept


def _groups(slots: torch.Tensor) -> RowGroups:
    groups: RowGroups = []
    for slot in torch.unique(slots).tolist():
        if slot == 0:
            continue
        rows = (slots == slot).nonzero().squeeze(1)
        groups.append((slot, None if rows.shape[0] == slots.shape[0] else rows))
    return groups


class LoraLinear(nn.Module):
    """A linear layer (plain, packed or quantized) plus the adapters that target it."""

    def __init__(self, base: nn.Module, batch: LoraBatch) -> None:
        super().__init__()
        self.base = base
        self.batch = batch
        # slot -> [(first output row, A [r, in], B [out, r] scaled)]
        self.parts: dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in] -> [T, out]."""
        out = self.base(x)
        for slot, rows in self.batch.groups(x.shape[0]):
            parts = self.parts.get(slot)
            if not parts:
                continue
            xs = x if rows is None else x.index_select(0, rows)
            for offset, a, b in parts:
                delta = torch.mm(torch.mm(xs, a.t()), b.t())
                target = out.narrow(1, offset, b.shape[0])
                if rows is None:
                    target.add_(delta)
                else:
                    target.index_add_(0, rows, delta)
        return out


def attach_adapters(model: nn.Module, adapters: Sequence[LoraAdapter]) -> LoraBatch:
    """Wrap every layer an adapter targets in a `LoraLinear`; adapter i gets slot i + 1.
    Call after the layers are quantized and packed: the wrapper takes them as they are."""
    batch = LoraBatch()
    wrapped: dict[str, LoraLinear] = {}
    for slot, adapter in enumerate(adapters, start=1):
        for layer, deltas in adapter.deltas.items():
            if layer not in wrapped:
                wrapped[layer] = _wrap(model, layer, batch)
            wrapped[layer].parts[slot] = [(d.offset, d.a, d.b) for d in deltas]
    return batch


def _wrap(model: nn.Module, name: str, batch: LoraBatch) -> LoraLinear:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    layer = LoraLinear(getattr(parent, child), batch)
    setattr(parent, child, layer)
    return layer
