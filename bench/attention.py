"""Attention over the paged KV cache: the native kernels against the engine's PyTorch path.

Prefill: one sequence's chunk of prompt tokens, first chunks and chunks after a cached
prefix (`prefill_attention.c` against PyTorch's fused attention, which first copies the
chunk's queries, keys and values into rows, and a cached prefix out of its blocks).
Decode: one query token for each of n sequences of the same length, on blocks drawn at
random from a cache the engine's size (`paged_decode.c` against a gather and batched
matrix multiplies). Each layer of the benchmark model has its own cache, so every read
comes from memory as in a real step; the two ways alternate, and the median is kept.

    python -m bench.attention [--threads 2 --repeats 21]

Last line: one JSON object: for each case, the PyTorch path's time over the kernel's, and
the rate at which the decode kernel reads the cache.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine import huge_pages, native
from engine.batch_inputs import AttentionShape, _decode_batch, _decode_groups, _prefill_span
from engine.batcher import ScheduledChunk
from engine.layers.paged_attention import PagedAttention, Workspace
from engine.native import DecodeKernel, PrefillKernel
from engine.sampling import SamplingParams
from engine.sequence import Sequence

LAYERS, HEADS, KV_HEADS, DIM, BLOCK_SIZE = 8, 8, 4, 64, 16
CACHE_BYTES = 1 << 30  # all layers, as bench.engine gives the engine
PREFILLS = ((64, 64), (264, 264), (512, 512), (256, 512), (100, 400))  # (chunk, context)
DECODES = ((16, 256), (64, 300), (32, 600))  # (sequences, context)


def _median_pair(
    repeats: int, first: Callable[[], None], second: Callable[[], None]
) -> tuple[float, float]:
    """Median seconds of each, run alternately."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for run, out in ((first, times[0]), (second, times[1])):
            start = time.perf_counter()
            run()
            out.append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def _sequences(lengths: list[int], tokens: int, pool: list[int]) -> list[ScheduledChunk]:
    """A chunk of the last `tokens` positions of each sequence, on blocks from `pool`."""
    chunks = []
    for i, length in enumerate(lengths):
        seq = Sequence(str(i), [5] * length, SamplingParams())
        seq.block_table = [pool.pop() for _ in range(-(-length // BLOCK_SIZE))]
        chunks.append(ScheduledChunk(seq, length - tokens, tokens))
    return chunks


@dataclass
class Setup:
    caches: list[torch.Tensor]  # one per layer
    pool: list[int]  # free block ids, in random order
    attention: PagedAttention
    workspace: Workspace
    repeats: int


def prefill_case(
    setup: Setup, kernel: PrefillKernel, tokens: int, context: int
) -> tuple[float, float]:
    """Seconds for the last `tokens` of a `context`-token prompt over every layer: the
    kernel's, then the PyTorch path's."""
    [chunk] = _sequences([context], tokens, setup.pool)
    table = torch.tensor(chunk.seq.block_table, dtype=torch.long)
    span = _prefill_span(chunk, 0, table, BLOCK_SIZE)
    qkv = torch.randn(tokens, HEADS + 2 * KV_HEADS, DIM)  # a fused projection's rows
    q, k, v = qkv[:, :HEADS], qkv[:, HEADS : HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS :]
    out = torch.empty(tokens, HEADS * DIM)
    scale = setup.attention.scale

    def with_kernel() -> None:
        for cache in setup.caches:
            kernel(q, cache, span.block_index, context, BLOCK_SIZE, scale, out)

    def with_pytorch() -> None:
        for cache in setup.caches:
            rows = (q.contiguous(), k.contiguous(), v.contiguous())
            setup.attention._prefill(*rows, cache, span, setup.workspace)

    return _median_pair(setup.repeats, with_kernel, with_pytorch)


def decode_case(
    setup: Setup, kernel: DecodeKernel, count: int, context: int
) -> tuple[float, float]:
    """Seconds for one decode step of `count` sequences of `context` tokens over every
    layer: the kernel's, then the PyTorch path's."""
    shape = AttentionShape(BLOCK_SIZE, KV_HEADS, HEADS // KV_HEADS)
    chunks = _sequences([context] * count, 1, setup.pool)
    batch = _decode_batch(chunks, shape, kernel)
    groups = _decode_groups(chunks, shape, torch.float32)
    q = torch.randn(count, HEADS, DIM)
    scale = setup.attention.scale

    def with_kernel() -> None:
        for cache in setup.caches:
            kernel(q, cache, batch.block_tables, batch.context_lens, BLOCK_SIZE, scale)

    def with_pytorch() -> None:
        for cache in setup.caches:
            for group in groups:
                rows = q[group.token_start : group.token_start + group.num_seqs]
                setup.attention._decode(rows, cache, group, setup.workspace)

    try:
        return _median_pair(setup.repeats, with_kernel, with_pytorch)
    finally:
        setup.pool.extend(block for chunk in chunks for block in chunk.seq.block_table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prefill_kernel, decode_kernel = native.prefill_attention(), native.paged_decode()
    if prefill_kernel is None or decode_kernel is None:
        raise SystemExit("the native kernels did not build here")
    slots = CACHE_BYTES // LAYERS // (2 * KV_HEADS * DIM * 4) // BLOCK_SIZE * BLOCK_SIZE
    pool = list(range(slots // BLOCK_SIZE))
    random.Random(0).shuffle(pool)
    setup = Setup(
        caches=[
            huge_pages.zeros(2, KV_HEADS, slots, DIM, dtype=torch.float32).normal_()
            for _ in range(LAYERS)
        ],
        pool=pool,
        attention=PagedAttention(HEADS, KV_HEADS, DIM, BLOCK_SIZE),
        workspace=Workspace(torch.float32),
        repeats=args.repeats,
    )
    prefill: dict[str, float] = {}
    decode: dict[str, float] = {}
    rates: dict[str, float] = {}
    print(f"prefill, {LAYERS} layers            {'kernel':>8} {'PyTorch':>8}  (ms, median)")
    for tokens, context in PREFILLS:
        fast, slow = prefill_case(setup, prefill_kernel, tokens, context)
        prefill[f"{tokens}/{context}"] = round(slow / fast, 2)
        print(f"{tokens:>5} of {context:<5} positions     {1e3 * fast:>8.2f} {1e3 * slow:>8.2f}")
    print(
        f"decode, {LAYERS} layers             {'kernel':>8} {'PyTorch':>8}  (ms, median)  kernel GB/s"
    )
    for count, context in DECODES:
        fast, slow = decode_case(setup, decode_kernel, count, context)
        rate = count * context * 2 * KV_HEADS * DIM * 4 * LAYERS / fast / 1e9
        decode[f"{count}x{context}"] = round(slow / fast, 2)
        rates[f"{count}x{context}"] = round(rate, 1)
        print(
            f"{count:>3} sequences of {context:<5}    {1e3 * fast:>8.2f} {1e3 * slow:>8.2f}  {rate:>25.1f}"
        )
    summary = {"prefill_speedup": prefill, "decode_speedup": decode, "decode_gb_per_s": rates}
    print(json.dumps({"threads": args.threads, **summary}))


if __name__ == "__main__":
    main()
