"""The native decode kernel against the PyTorch path, and how it is built."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import native
from engine.batch_inputs import AttentionShape, _decode_batch, _decode_groups
from engine.batcher import ScheduledChunk
from engine.layers.paged_attention import PagedAttention, Workspace
from engine.llm_engine import LLMEngine
from engine.native import library
from engine.sampling import SamplingParams
from engine.sequence import Sequence

KERNEL = native.paged_decode()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="the native kernel did not build here")


def _decodes(lengths: list[int], block_size: int, num_blocks: int) -> list[ScheduledChunk]:
    """One decode per length, each sequence on blocks drawn at random from the pool."""
    free = list(range(num_blocks))
    random.Random(0).shuffle(free)
    chunks = []
    for i, length in enumerate(sorted(lengths, reverse=True)):
        seq = Sequence(str(i), [5] * length, SamplingParams())
        seq.block_table = [free.pop() for _ in range(-(-length // block_size))]
        chunks.append(ScheduledChunk(seq, length - 1, 1))
    return chunks


@needs_kernel
@pytest.mark.parametrize(
    ("head_dim", "heads", "kv_heads", "kv_dtype"),
    [
        (64, 8, 4, torch.float32),
        (32, 8, 4, torch.float32),
        (128, 4, 4, torch.float32),
        (48, 8, 2, torch.float32),
        (64, 8, 1, torch.bfloat16),
        (128, 8, 2, torch.bfloat16),
        (64, 9, 3, torch.float32),  # SmolLM2's three query heads per KV head
        (64, 7, 1, torch.bfloat16),  # a group that is not a whole number of passes
        (128, 5, 1, torch.float32),
    ],
)
def test_kernel_matches_the_pytorch_decode(
    head_dim: int, heads: int, kv_heads: int, kv_dtype: torch.dtype
) -> None:
    assert KERNEL is not None
    block_size, num_blocks = 16, 160
    torch.manual_seed(0)
    cache = torch.randn(2, kv_heads, num_blocks * block_size, head_dim).to(kv_dtype)
    chunks = _decodes([1, 5, 16, 17, 100, 333, 700], block_size, num_blocks)
    q = torch.randn(len(chunks), heads, head_dim)
    attention = PagedAttention(heads, kv_heads, head_dim, block_size)
    shape = AttentionShape(block_size, kv_heads, heads // kv_heads)

    workspace = Workspace(torch.float32)
    expected = torch.cat(
        [
            attention._decode(q[g.token_start : g.token_start + g.num_seqs], cache, g, workspace)
            for g in _decode_groups(chunks, shape, torch.float32)
        ]
    )
    batch = _decode_batch(chunks, shape, KERNEL)
    got = KERNEL(q, cache, batch.block_tables, batch.context_lens, block_size, attention.scale)

    assert got.shape == (len(chunks), heads * head_dim)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5), (got - expected).abs().max()


@needs_kernel
def test_the_kernel_refuses_inputs_it_would_misread() -> None:
    assert KERNEL is not None
    cache = torch.zeros(2, 2, 64, 16)
    tables, lens = torch.zeros(1, 4, dtype=torch.long), torch.tensor([3])
    q = torch.zeros(1, 4, 16)
    assert KERNEL(q, cache, tables, lens, 16, 0.25).shape == (1, 64)
    bad = [
        (q.double(), cache, tables, lens),
        (q, cache.half(), tables, lens),
        (q, cache.transpose(2, 3), tables, lens),
        (q, cache, tables.int(), lens),
        (q, cache, tables, torch.tensor([3, 3])),
        (torch.zeros(1, 4, 8), cache, tables, lens),  # head size differs from the cache's
        (torch.zeros(1, 3, 16), cache, tables, lens),  # heads not a multiple of KV heads
        (q, cache[:1], tables, lens),  # keys without their values
        (q, cache[0], tables, lens),
    ]
    for args in bad:
        with pytest.raises(ValueError):
            KERNEL(*args, 16, 0.25)


@needs_kernel
def test_engine_gives_the_same_greedy_tokens_with_and_without_the_kernel(
    make_engine: Callable[..., LLMEngine],
) -> None:
    prompts = [[(7 * i + j) % 200 + 3 for j in range(n)] for i, n in enumerate((3, 19, 41, 60))]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    results = []
    for kernel in (None, KERNEL):
        engine = make_engine()
        engine.runner.decode_kernel = kernel
        results.append([r.token_ids for r in engine.generate(prompts, params)])
    assert results[0] == results[1]


@needs_kernel
def test_a_build_without_openmp_computes_the_same(tmp_path: Path) -> None:
    assert KERNEL is not None
    single = native.load(library._build(["cc"], library.FLAGS, tmp_path)).paged_decode
    torch.manual_seed(1)
    cache = torch.randn(2, 2, 64 * 16, 64)
    chunks = _decodes([40, 300, 9], 16, 64)
    batch = _decode_batch(chunks, AttentionShape(16, 2, 4), KERNEL)
    q = torch.randn(3, 8, 64)
    args = (q, cache, batch.block_tables, batch.context_lens, 16, 0.125)
    assert torch.allclose(single(*args), KERNEL(*args), atol=1e-6)


@needs_kernel
def test_loading_the_kernel_leaves_the_process_floating_point_mode_alone(tmp_path: Path) -> None:
    native.load(native.build(directory=tmp_path) or Path("missing"))

    def scaled(x: float) -> float:
        return x * 0.5

    assert scaled(1e-320) > 0  # subnormals are not flushed to zero
    assert torch.tensor([1e-40]).mul(0.5).item() > 0


def test_a_failing_compiler_leaves_attention_in_pytorch(tmp_path: Path) -> None:
    assert native.build(compiler="false", directory=tmp_path) is None
    assert list(tmp_path.glob("*.so")) == []


@needs_kernel
def test_the_library_is_built_once_per_source_compiler_and_cpu(tmp_path: Path) -> None:
    first = native.build(directory=tmp_path)
    assert first is not None
    built_at = first.stat().st_mtime_ns
    assert native.build(directory=tmp_path) == first
    assert first.stat().st_mtime_ns == built_at
    other = native.build(compiler="cc -g0", directory=tmp_path)
    assert other is not None and other != first


def test_the_kernel_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOLLGATE_NATIVE_KERNELS", "0")
    assert native.paged_decode() is None
