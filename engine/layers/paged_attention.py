"""Attention over a paged KV cache for a flat batch of decode tokens and prefill chunks.

Layout of one layer's cache: [2, kv_heads, num_blocks * block_size, head_dim] (keys, values).
Slot `s` of the flat token axis is position `s % block_size` of block `s // block_size`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.native import DecodeKernel, PrefillKernel


class Workspace:
    """Reusable buffers, one per dtype: fresh large allocations page-fault on every step.

    `dtype` is the dtype attention computes in.
    """

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._buffers: dict[torch.dtype, torch.Tensor] = {}

    def buffer(self, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.dtype
        numel = 1
        for size in shape:
            numel *= size
        current = self._buffers.get(dtype)
        if current is None or current.numel() < numel:
            current = self._buffers[dtype] = torch.empty(numel, dtype=dtype)
        return current[:numel].view(shape)


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    """Consecutive single-token queries whose contexts are padded to one length."""

    token_start: int
    num_seqs: int
    max_blocks: int
    block_index: torch.Tensor  # [num_seqs * max_blocks] block ids, padding points at block 0
    bias: torch.Tensor  # [kv_heads * num_seqs, group_size, max_blocks * block_size]: 0 or -inf


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """Every single-token query of the step, for a kernel that reads the cache in place."""

    num_seqs: int
    block_tables: torch.Tensor  # [num_seqs, max_blocks] block ids, padding points at block 0
    context_lens: torch.Tensor  # [num_seqs]
    kernel: DecodeKernel


@dataclass(frozen=True, slots=True)
class PrefillSpan:
    """A chunk of `num_query` prompt tokens of one sequence with `context_len` tokens in view."""

    token_start: int
    num_query: int
    context_len: int
    block_index: torch.Tensor  # [num_blocks] the sequence's blocks
    mask: torch.Tensor | None  # [num_query, context_len] bool, None when there is no cached prefix


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Where each token of the flat batch writes its key/value and what it attends to."""

    slot_mapping: torch.Tensor  # [T]
    decode_batch: DecodeBatch | None  # the decodes when a native kernel computes them
    decode_groups: tuple[DecodeGroup, ...]  # else the decodes, computed here
    prefills: tuple[PrefillSpan, ...]
    workspace: Workspace
    # Computes the prefills from the cache when given (and their queries are rows of heads).
    prefill_kernel: PrefillKernel | None = None


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.group_size = num_heads // num_kv_heads
        self.scale = head_dim**-0.5

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D], kv_cache: [2, KVH, slots, D] -> [T, H * D].

        The cache may store a narrower dtype than q/k/v; it is widened back on reading.
        """
        kv_cache[0].index_copy_(1, meta.slot_mapping, k.transpose(0, 1).to(kv_cache.dtype))
        kv_cache[1].index_copy_(1, meta.slot_mapping, v.transpose(0, 1).to(kv_cache.dtype))
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        batch = meta.decode_batch
        if batch is not None:
            out[: batch.num_seqs] = batch.kernel(
                q[: batch.num_seqs],
                kv_cache,
                batch.block_tables,
                batch.context_lens,
                self.block_size,
                self.scale,
            )
        for group in meta.decode_groups:
            end = group.token_start + group.num_seqs
            out[group.token_start : end] = self._decode(
                q[group.token_start : end], kv_cache, group, meta.workspace
            )
        native_prefill = meta.prefill_kernel if _rows_of_heads(q) else None
        for span in meta.prefills:
            end = span.token_start + span.num_query
            rows = slice(span.token_start, end)
            if native_prefill is not None:
                native_prefill(
                    q[rows],
                    kv_cache,
                    span.block_index,
                    span.context_len,
                    self.block_size,
                    self.scale,
                    out[rows],
                )
                continue
            # Projections of small batches come laid out transposed (see linear.py); the
            # fused CPU attention kernel wants rows, else a slower path is taken.
            out[rows] = self._prefill(
                q[rows].contiguous(),
                k[rows].contiguous(),
                v[rows].contiguous(),
                kv_cache,
                span,
                meta.workspace,
            )
        return out

    def _gather(
        self, kv_cache: torch.Tensor, block_index: torch.Tensor, workspace: Workspace
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the listed blocks, each [KVH, len(block_index) * block_size, D],
        in the workspace's dtype."""
        kvh, row = self.num_kv_heads, self.block_size * self.head_dim
        # Keys and values of every head in one copy: [2 * KVH, blocks, block_size * D].
        blocks = kv_cache.view(2 * kvh, -1, row)
        shape = (2 * kvh, block_index.numel(), row)
        gathered = workspace.buffer(shape, kv_cache.dtype)
        torch.index_select(blocks, 1, block_index, out=gathered)
        if gathered.dtype != workspace.dtype:
            gathered = workspace.buffer(shape).copy_(gathered)
        both = gathered.view(2, kvh, -1, self.head_dim)
        return both[0], both[1]

    def _decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, group: DecodeGroup, workspace: Workspace
    ) -> torch.Tensor:
        n, kvh, g, d = group.num_seqs, self.num_kv_heads, self.group_size, self.head_dim
        keys, values = self._gather(kv_cache, group.block_index, workspace)
        length = group.max_blocks * self.block_size
        keys = keys.view(kvh * n, length, d)
        values = values.view(kvh * n, length, d)
        # q: [n, H, D] -> [KVH * n, G, D], matching the (head, sequence) order of the gather.
        queries = q.view(n, kvh, g, d).transpose(0, 1).reshape(kvh * n, g, d)
        scores = torch.baddbmm(group.bias, queries, keys.transpose(1, 2), alpha=self.scale)
        probs = torch.softmax(scores, dim=-1)
        out = torch.bmm(probs, values)  # [KVH * n, G, D]
        return out.view(kvh, n, g * d).transpose(0, 1).reshape(n, kvh * g * d)

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        span: PrefillSpan,
        workspace: Workspace,
    ) -> torch.Tensor:
        queries = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if span.mask is None:
            # A first chunk reads its own fresh keys and values: full precision even when
            # the cache stores them narrower.
            keys, values = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            out = F.scaled_dot_product_attention(
                queries,
                keys,
                values,
                is_causal=True,
                scale=self.scale,
                enable_gqa=self.group_size > 1,
            )
        else:
            all_keys, all_values = self._gather(kv_cache, span.block_index, workspace)
            keys = all_keys[:, : span.context_len].unsqueeze(0)
            values = all_values[:, : span.context_len].unsqueeze(0)
            out = F.scaled_dot_product_attention(
                queries,
                keys,
                values,
                attn_mask=span.mask,
                scale=self.scale,
                enable_gqa=self.group_size > 1,
            )
        return out[0].transpose(0, 1).reshape(span.num_query, self.num_heads * self.head_dim)


def _rows_of_heads(x: torch.Tensor) -> bool:
    """Whether x: [T, heads, D] holds each token's heads side by side (any row stride)."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]
