"""The native prefill attention kernel against float64 attention, and in the engine."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import native
from engine.layers.paged_attention import AttentionMetadata, PagedAttention, PrefillSpan, Workspace
from engine.llm_engine import LLMEngine
from engine.native import library
from engine.sampling import SamplingParams

KERNEL = native.prefill_attention()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="the native kernels did not build here")
BLOCK_SIZE, NUM_BLOCKS = 16, 96


def _reference(
    q: torch.Tensor, cache: torch.Tensor, blocks: torch.Tensor, context_len: int
) -> torch.Tensor:
    """Causal attention in float64 of q's rows, the last positions of `context_len`."""
    n, heads, dim = q.shape
    positions = torch.arange(context_len)
    slots = blocks[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    keys, values = cache[0][:, slots].double(), cache[1][:, slots].double()
    seen = positions.unsqueeze(0) <= torch.arange(context_len - n, context_len).unsqueeze(1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0).double(),
        keys.unsqueeze(0),
        values.unsqueeze(0),
        attn_mask=seen,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1).reshape(n, heads * dim)


def _case(
    n: int, context_len: int, heads: int, kv_heads: int, dim: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries laid out as in a fused QKV projection's output (rows wider than the
    queries), a cache, and the sequence's blocks drawn at random from the pool."""
    generator = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, kv_heads, NUM_BLOCKS * BLOCK_SIZE, dim, generator=generator)
    blocks = torch.randperm(NUM_BLOCKS, generator=generator)[: -(-context_len // BLOCK_SIZE)]
    qkv = torch.randn(n, heads + 2 * kv_heads, dim, generator=generator)
    return qkv[:, :heads], cache, blocks


@needs_kernel
@pytest.mark.parametrize(
    ("n", "context_len"),
    [(1, 1), (5, 5), (6, 6), (7, 7), (64, 64), (131, 131), (513, 513), (1, 300), (40, 97)],
)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"), [(8, 4, 64), (4, 4, 32), (8, 1, 128), (6, 2, 16)]
)
def test_the_kernel_matches_causal_attention(
    n: int, context_len: int, heads: int, kv_heads: int, dim: int
) -> None:
    """A first chunk (n == context_len) and chunks after a cached prefix; every tail of
    the 6-row tiles and of the 16-position panels; grouped-query heads."""
    assert KERNEL is not None
    q, cache, blocks = _case(n, context_len, heads, kv_heads, dim)
    out = torch.full((n, heads * dim), float("nan"))
    KERNEL(q, cache, blocks, context_len, BLOCK_SIZE, dim**-0.5, out)
    expected = _reference(q, cache, blocks, context_len)
    assert torch.allclose(out.double(), expected, atol=2e-6), (out - expected).abs().max()


@needs_kernel
def test_the_output_rows_may_be_strided_and_nothing_else_is_written() -> None:
    assert KERNEL is not None
    q, cache, blocks = _case(9, 30, 8, 4, 64)
    wide = torch.zeros(9, 3 * 8 * 64)
    KERNEL(q, cache, blocks, 30, BLOCK_SIZE, 0.125, wide[:, 512:1024])
    expected = _reference(q, cache, blocks, 30)
    assert torch.allclose(wide[:, 512:1024].double(), expected, atol=2e-6)
    assert not wide[:, :512].any() and not wide[:, 1024:].any()


@needs_kernel
def test_each_thread_count_and_a_build_without_openmp_give_the_same_bits(
    tmp_path: Path,
) -> None:
    assert KERNEL is not None
    single = native.load(library._build(["cc"], library.FLAGS, tmp_path)).prefill_attention
    q, cache, blocks = _case(200, 260, 8, 4, 64, seed=3)
    results = []
    threads = torch.get_num_threads()
    try:
        for count, kernel in ((1, KERNEL), (2, KERNEL), (3, KERNEL), (2, single)):
            torch.set_num_threads(count)
            out = torch.empty(200, 512)
            kernel(q, cache, blocks, 260, BLOCK_SIZE, 0.125, out)
            results.append(out)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(results[0], other) for other in results[1:])


@needs_kernel
def test_the_kernel_refuses_inputs_it_would_misread() -> None:
    assert KERNEL is not None
    q, cache, blocks = _case(4, 20, 4, 2, 16)
    out = torch.empty(4, 64)
    KERNEL(q, cache, blocks, 20, BLOCK_SIZE, 0.25, out)
    bad = [
        (q.double(), cache, blocks, 20, out),
        (q, cache.half(), blocks, 20, out),  # float16: neither cache it reads
        (q, cache.transpose(2, 3), blocks, 20, out),
        (q.transpose(1, 2), cache, blocks, 20, out),  # heads not side by side
        (torch.zeros(4, 4, 8), torch.zeros(2, 2, 64, 8), blocks, 20, out[:, :32]),  # D % 16
        (torch.zeros(4, 3, 16), cache, blocks, 20, torch.empty(4, 48)),  # heads % KV heads
        (q, cache, blocks.int(), 20, out),
        (q, cache, blocks[:1], 20, out),  # too few blocks for the context
        (q, cache, torch.tensor([0, NUM_BLOCKS]), 20, out),  # a block past the cache
        (q, cache, torch.tensor([-1, 0]), 20, out),
        (q, cache, blocks, 3, out),  # more queries than positions
        (q, cache, blocks, 20, torch.empty(4, 32)),
        (q, cache, blocks, 20, torch.empty(64, 4).t()),
        (q, cache[:1], blocks, 20, out),  # keys without their values
        (q, cache[0], blocks, 20, out),
    ]
    for q_, cache_, blocks_, context_len, out_ in bad:
        with pytest.raises(ValueError):
            KERNEL(q_, cache_, blocks_, context_len, BLOCK_SIZE, 0.25, out_)


def test_the_kernel_is_offered_for_float32_and_bfloat16_caches() -> None:
    assert native.supports_prefill(torch.float32, torch.float32, 64)
    assert native.supports_prefill(torch.float32, torch.bfloat16, 64)
    assert not native.supports_prefill(torch.float32, torch.float16, 64)
    assert not native.supports_prefill(torch.float32, torch.float32, 40)


@needs_kernel
@pytest.mark.parametrize(("n", "context_len"), [(7, 7), (131, 131), (40, 97)])
def test_a_bfloat16_cache_is_read_as_its_values_widened(n: int, context_len: int) -> None:
    """The chunk's own keys and values too come from the cache, rounded as stored."""
    assert KERNEL is not None
    q, cache, blocks = _case(n, context_len, 9, 3, 64)
    rounded = cache.bfloat16()
    out = torch.full((n, 9 * 64), float("nan"))
    KERNEL(q, rounded, blocks, context_len, BLOCK_SIZE, 64**-0.5, out)
    expected = _reference(q, rounded.float(), blocks, context_len)
    assert torch.allclose(out.double(), expected, atol=2e-6), (out - expected).abs().max()


def _forward(
    qkv: torch.Tensor, context_len: int, kernel: native.PrefillKernel | None
) -> torch.Tensor:
    """PagedAttention.forward over one first chunk of `context_len` tokens."""
    heads, kv_heads, dim = 8, 4, 64
    cache = torch.zeros(2, kv_heads, NUM_BLOCKS * BLOCK_SIZE, dim)
    blocks = torch.arange(5, 5 + -(-context_len // BLOCK_SIZE))
    positions = torch.arange(context_len)
    meta = AttentionMetadata(
        slot_mapping=blocks[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE,
        decode_batch=None,
        decode_groups=(),
        prefills=(PrefillSpan(0, context_len, context_len, blocks, None),),
        workspace=Workspace(torch.float32),
        prefill_kernel=kernel,
    )
    q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    return PagedAttention(heads, kv_heads, dim, BLOCK_SIZE)(q, k, v, cache, meta)


@needs_kernel
def test_forward_computes_prefills_with_the_kernel_when_the_queries_are_rows() -> None:
    """With rows of heads (the packed projections' output) the kernel computes the chunk;
    laid out otherwise (unpacked layers' transposed output), PyTorch does, unchanged."""
    torch.manual_seed(5)
    rows = torch.randn(37, 16, 64)
    transposed = torch.randn(64, 16, 37).permute(2, 1, 0)
    assert torch.allclose(_forward(rows, 37, KERNEL), _forward(rows, 37, None), atol=1e-5)
    assert torch.equal(_forward(transposed, 37, KERNEL), _forward(transposed, 37, None))


@needs_kernel
def test_engine_gives_the_same_greedy_tokens_with_and_without_the_kernel(
    make_engine: Callable[..., LLMEngine],
) -> None:
    """Prompts long enough to be prefilled in several chunks, some sharing a cached
    prefix, so both the first-chunk and the cached-prefix cases run."""
    shared = [(11 * j) % 190 + 5 for j in range(48)]
    prompts = [
        shared + [(7 * i + j) % 200 + 3 for j in range(n)] for i, n in enumerate((3, 40, 90))
    ]
    prompts.append([(5 * j) % 180 + 4 for j in range(150)])
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    results = []
    for kernel in (None, KERNEL):
        engine = make_engine(max_num_batched_tokens=64)
        assert engine.runner.prefill_kernel is not None  # the tiny model's heads fit it
        engine.runner.prefill_kernel = kernel
        results.append([r.token_ids for r in engine.generate(prompts, params)])
    assert results[0] == results[1]


@needs_kernel
def test_an_engine_with_a_bf16_cache_prefills_with_the_kernel(
    make_engine: Callable[..., LLMEngine],
) -> None:
    """Its chunks attend to the cache's rounded keys, as its decode steps do; on the tiny
    model the greedy tokens are those of the PyTorch path, which attends to a chunk's
    exact ones."""
    prompts = [[(5 * j + i) % 180 + 4 for j in range(n)] for i, n in enumerate((30, 150))]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    results = []
    for kernel in (None, KERNEL):
        engine = make_engine(kv_dtype="bfloat16", max_num_batched_tokens=64)
        assert engine.runner.prefill_kernel is not None
        engine.runner.prefill_kernel = kernel
        results.append([r.token_ids for r in engine.generate(prompts, params)])
    assert results[0] == results[1]
