"""Tensors for one step, built from the batcher's plan.

Single-token chunks come first, sorted by context length (longest first). A native decode
kernel takes them all at once; otherwise they are split into groups whose contexts pad to
similar lengths. Prefill chunks follow, one span each.

Besides the last row of each chunk that samples, the model keeps the rows that score the
prompt of a request asking for prompt logprobs: the row at position p gives the
distribution of the prompt token at p + 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.batcher import ScheduledChunk, StepPlan
from engine.layers.paged_attention import (
    AttentionMetadata,
    DecodeBatch,
    DecodeGroup,
    PrefillSpan,
    Workspace,
)
from engine.native import DecodeKernel, PrefillKernel

# Bounds the gather workspace (and the padded bias) of one decode group.
_MAX_GROUP_TOKENS = 1 << 16


@dataclass(frozen=True, slots=True)
class BatchInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attention: AttentionMetadata
    logits_indices: torch.Tensor  # [N] rows of the hidden states to sample from
    sampled: tuple[ScheduledChunk, ...]  # the chunk each sampled row belongs to
    adapter_slots: torch.Tensor | None = None  # [T]; None when every row is the base model's
    # [M] rows whose next prompt token is scored, and (chunk, first position, rows) of each
    # chunk they come from, in that order.
    scored_indices: torch.Tensor | None = None
    scored: tuple[tuple[ScheduledChunk, int, int], ...] = ()

    @property
    def kept_indices(self) -> torch.Tensor:
        """The rows of the hidden states the step needs: the sampled, then the scored."""
        if self.scored_indices is None:
            return self.logits_indices
        return torch.cat([self.logits_indices, self.scored_indices])


@dataclass(frozen=True, slots=True)
class AttentionShape:
    block_size: int
    num_kv_heads: int
    group_size: int


def build_inputs(
    plan: StepPlan,
    shape: AttentionShape,
    workspace: Workspace,
    decode_kernel: DecodeKernel | None = None,
    prefill_kernel: PrefillKernel | None = None,
) -> BatchInputs:
    decodes = sorted(
        (c for c in plan.chunks if c.num_tokens == 1), key=lambda c: c.start, reverse=True
    )
    prefills = [c for c in plan.chunks if c.num_tokens > 1]
    input_ids: list[int] = [c.seq.token_ids[c.start] for c in decodes]
    positions: list[torch.Tensor] = [torch.tensor([c.start for c in decodes], dtype=torch.long)]
    slots: list[torch.Tensor] = [
        torch.tensor(
            [_slot(c.seq.block_table, c.start, shape.block_size) for c in decodes], dtype=torch.long
        )
    ]
    spans: list[PrefillSpan] = []
    for chunk in prefills:
        span_positions = torch.arange(chunk.start, chunk.start + chunk.num_tokens)
        table = torch.tensor(chunk.seq.block_table, dtype=torch.long)
        spans.append(_prefill_span(chunk, len(input_ids), table, shape.block_size))
        input_ids.extend(chunk.seq.token_ids[chunk.start : chunk.start + chunk.num_tokens])
        positions.append(span_positions)
        slots.append(
            table[span_positions // shape.block_size] * shape.block_size
            + span_positions % shape.block_size
        )
    order = [*decodes, *prefills]
    ends = torch.tensor([c.num_tokens for c in order], dtype=torch.long).cumsum(0) - 1
    sampled_rows = [i for i, c in enumerate(order) if c.samples]
    scored, scored_indices = _scored(order, ends)
    batch = _decode_batch(decodes, shape, decode_kernel) if decode_kernel and decodes else None
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        decode_batch=batch,
        decode_groups=() if batch else tuple(_decode_groups(decodes, shape, workspace.dtype)),
        prefills=tuple(spans),
        workspace=workspace,
        prefill_kernel=prefill_kernel,
    )
    return BatchInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.long),
        positions=torch.cat(positions),
        attention=meta,
        logits_indices=ends[sampled_rows],
        sampled=tuple(order[i] for i in sampled_rows),
        adapter_slots=_adapter_slots(order),
        scored_indices=scored_indices,
        scored=scored,
    )


def _scored(
    order: list[ScheduledChunk], ends: torch.Tensor
) -> tuple[tuple[tuple[ScheduledChunk, int, int], ...], torch.Tensor | None]:
    """The chunks whose prompt positions are scored, and their rows: each position p of
    the chunk below the prompt's last, whose token p + 1 is the prompt's."""
    scored, rows = [], []
    for i, chunk in enumerate(order):
        if chunk.seq.params.prompt_logprobs is None:
            continue
        last = min(chunk.start + chunk.num_tokens, chunk.seq.num_prompt_tokens - 1)
        if last <= chunk.start:
            continue
        first_row = int(ends[i]) - chunk.num_tokens + 1
        scored.append((chunk, chunk.start, last - chunk.start))
        rows.append(torch.arange(first_row, first_row + last - chunk.start))
    return tuple(scored), torch.cat(rows) if rows else None


def _adapter_slots(order: list[ScheduledChunk]) -> torch.Tensor | None:
    if all(c.seq.adapter_slot == 0 for c in order):
        return None
    return torch.tensor([c.seq.adapter_slot for c in order for _ in range(c.num_tokens)])


def _slot(block_table: list[int], position: int, block_size: int) -> int:
    return block_table[position // block_size] * block_size + position % block_size


def _prefill_span(
    chunk: ScheduledChunk, token_start: int, table: torch.Tensor, block_size: int
) -> PrefillSpan:
    context = chunk.start + chunk.num_tokens
    mask = None
    if chunk.start > 0:
        # Query i sits at position start + i and sees every position up to its own.
        queries = torch.arange(chunk.start, context).unsqueeze(1)
        mask = torch.arange(context).unsqueeze(0) <= queries
    return PrefillSpan(
        token_start=token_start,
        num_query=chunk.num_tokens,
        context_len=context,
        block_index=table[: -(-context // block_size)],
        mask=mask,
    )


def _decode_batch(
    decodes: list[ScheduledChunk], shape: AttentionShape, kernel: DecodeKernel
) -> DecodeBatch:
    width = _num_blocks(decodes[0], shape.block_size)  # decodes are longest first
    tables = [c.seq.block_table[:width] for c in decodes]
    return DecodeBatch(
        num_seqs=len(decodes),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long),
        context_lens=torch.tensor([c.start + 1 for c in decodes], dtype=torch.long),
        kernel=kernel,
    )


def _decode_groups(
    decodes: list[ScheduledChunk], shape: AttentionShape, dtype: torch.dtype
) -> list[DecodeGroup]:
    """Split decodes (longest context first) so no group pads a context to more than twice
    its size, nor gathers more than `_MAX_GROUP_TOKENS` positions."""
    groups: list[DecodeGroup] = []
    start = 0
    while start < len(decodes):
        widest = _num_blocks(decodes[start], shape.block_size)
        limit = start + max(1, _MAX_GROUP_TOKENS // (widest * shape.block_size))
        end = start + 1
        while (
            end < min(len(decodes), limit)
            and 2 * _num_blocks(decodes[end], shape.block_size) > widest
        ):
            end += 1
        groups.append(_decode_group(decodes[start:end], start, widest, shape, dtype))
        start = end
    return groups


def _num_blocks(chunk: ScheduledChunk, block_size: int) -> int:
    return -(-(chunk.start + 1) // block_size)


def _decode_group(
    chunks: list[ScheduledChunk],
    token_start: int,
    max_blocks: int,
    shape: AttentionShape,
    dtype: torch.dtype,
) -> DecodeGroup:
    index: list[int] = []
    for chunk in chunks:
        table = chunk.seq.block_table[:max_blocks]
        index.extend(table)
        index.extend([0] * (max_blocks - len(table)))
    length = max_blocks * shape.block_size
    context = torch.tensor([c.start + 1 for c in chunks], dtype=torch.long)
    padding = torch.arange(length).unsqueeze(0) >= context.unsqueeze(1)  # [n, L]
    bias = torch.zeros(len(chunks), length, dtype=dtype).masked_fill(padding, float("-inf"))
    n, kvh, g = len(chunks), shape.num_kv_heads, shape.group_size
    # Laid out (kv head, sequence) to match the gathered keys: [KVH * n, G, L].
    bias = bias.unsqueeze(0).unsqueeze(2).expand(kvh, n, g, length).reshape(kvh * n, g, length)
    return DecodeGroup(
        token_start=token_start,
        num_seqs=n,
        max_blocks=max_blocks,
        block_index=torch.tensor(index, dtype=torch.long),
        bias=bias,
    )
