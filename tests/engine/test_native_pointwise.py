"""The native row-wise kernels (RMS norm, rotary embeddings, SiLU gating) against PyTorch."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from engine import native
from engine.config import RopeConfig
from engine.layers.rms_norm import RMSNorm
from engine.layers.rotary import NativeRotation, RotaryEmbedding, TableRotation
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams

KERNELS = native.kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="the native kernels did not build here")


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 200])
def test_rms_norm_adds_the_residual_in_place_then_normalises(rows: int) -> None:
    torch.manual_seed(rows)
    norm = RMSNorm(72, eps=1e-5)
    norm.weight.data = torch.randn(72)
    x, delta = torch.randn(rows, 72), torch.randn(rows, 72)
    residual = x + delta
    expected = F.rms_norm(residual.double(), (72,), norm.weight.double(), 1e-5)

    got = norm(x, residual_delta=delta)
    assert torch.allclose(x, residual)  # x is the residual stream, updated
    assert torch.allclose(got.double(), expected, atol=1e-5)
    assert torch.allclose(norm(x).double(), expected, atol=1e-5)


@needs_kernels
def test_rms_norm_of_strided_rows_takes_the_pytorch_path() -> None:
    norm = RMSNorm(16)
    x, delta = torch.randn(4, 32)[:, ::2], torch.randn(4, 16)
    expected_residual = x + delta
    got = norm(x, residual_delta=delta)
    assert torch.allclose(x, expected_residual)
    assert torch.allclose(got, F.rms_norm(expected_residual, (16,), norm.weight, norm.eps))


@needs_kernels
def test_native_rotation_rotates_strided_rows_in_place_as_the_tables_do() -> None:
    rotary = RotaryEmbedding(32, RopeConfig(theta=10000.0))
    positions = torch.tensor([0, 5, 6, 700, 3])
    rotation = rotary.rotation(positions, torch.float32)
    assert isinstance(rotation, NativeRotation)
    cos = rotary._cos.index_select(0, positions).unsqueeze(1)
    sin = rotary._sin.index_select(0, positions).unsqueeze(1)
    # Queries and keys of 3 + 2 heads, then values: the rotated part is a strided view.
    qkv = torch.randn(5, 7 * 32)
    qk = qkv[:, : 5 * 32].view(5, 5, 32)
    untouched = qkv[:, 5 * 32 :].clone()
    expected = TableRotation(cos, sin)(qk.clone())

    got = rotation(qk)
    assert got.data_ptr() == qkv.data_ptr()  # in place
    assert torch.allclose(got, expected, atol=1e-5)
    assert torch.equal(qkv[:, 5 * 32 :], untouched)


@needs_kernels
def test_native_rotation_of_a_transposed_layout_rotates_a_copy() -> None:
    rotary = RotaryEmbedding(16, RopeConfig(theta=10000.0))
    positions = torch.arange(4)
    rotation = rotary.rotation(positions, torch.float32)
    x = torch.randn(2 * 16, 4).t().view(4, 2, 16)  # rows laid out transposed
    before = x.clone()
    cos = rotary._cos[:4].unsqueeze(1)
    sin = rotary._sin[:4].unsqueeze(1)
    got = rotation(x)
    assert torch.allclose(got, TableRotation(cos, sin)(before), atol=1e-5)
    assert torch.equal(x, before)


def test_other_dtypes_rotate_through_the_tables() -> None:
    rotary = RotaryEmbedding(16, RopeConfig(theta=10000.0))
    assert isinstance(rotary.rotation(torch.arange(3), torch.bfloat16), TableRotation)


@needs_kernels
@pytest.mark.parametrize("width", [8, 13, 704])
def test_silu_mul_matches_pytorch(width: int) -> None:
    assert KERNELS is not None
    gate_up = torch.randn(9, 2 * width) * 6
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate.double()) * up.double()
    got = KERNELS.silu_mul(gate_up)
    assert got.shape == (9, width)
    assert torch.allclose(got.double(), expected, rtol=1e-6, atol=1e-6)


@needs_kernels
def test_silu_mul_saturates_where_the_exponential_overflows() -> None:
    assert KERNELS is not None
    # 13 columns: 8 through the vector code, 5 through the scalar tail.
    gate = torch.tensor([-1e37, -1000.0, -90.0, -88.5, 90.0, 1000.0, float("inf"), 3.0] * 2)[:13]
    up = torch.full_like(gate, 1e30)
    got = KERNELS.silu_mul(torch.cat([gate, up]).view(1, -1))[0]
    assert torch.equal(got[:4], torch.zeros(4)) and torch.equal(got[8:12], torch.zeros(4))
    assert torch.allclose(got.double(), F.silu(gate.double()) * up.double(), rtol=1e-6, atol=1e-6)


@needs_kernels
def test_the_kernels_refuse_inputs_they_would_misread() -> None:
    assert KERNELS is not None
    weight = torch.ones(8)
    bad_calls: list[Callable[[], object]] = [
        lambda: KERNELS.rms_norm(torch.randn(2, 8).double(), weight, 1e-6, None),
        lambda: KERNELS.rms_norm(torch.randn(2, 9), weight, 1e-6, None),
        lambda: KERNELS.rms_norm(torch.randn(2, 16)[:, ::2], weight, 1e-6, None),
        lambda: KERNELS.rms_norm(torch.randn(2, 8), weight, 1e-6, torch.randn(3, 8)),
        lambda: KERNELS.silu_mul(torch.randn(2, 7)),
        lambda: KERNELS.silu_mul(torch.randn(2, 16)[:, ::2]),
        lambda: KERNELS.rotary(
            torch.randn(2, 3, 8), torch.arange(3), torch.ones(4, 4), torch.ones(4, 4)
        ),
        lambda: KERNELS.rotary(
            torch.randn(2, 3, 8), torch.arange(2).int(), torch.ones(4, 4), torch.ones(4, 4)
        ),
        lambda: KERNELS.rotary(
            torch.randn(2, 3, 8), torch.arange(2), torch.ones(4, 3), torch.ones(4, 3)
        ),
        # Positions past the tables, or before them: read out of bounds.
        lambda: KERNELS.rotary(
            torch.randn(2, 3, 8), torch.tensor([0, 4]), torch.ones(4, 4), torch.ones(4, 4)
        ),
        lambda: KERNELS.rotary(
            torch.randn(2, 3, 8), torch.tensor([-1, 2]), torch.ones(4, 4), torch.ones(4, 4)
        ),
    ]
    for call in bad_calls:
        with pytest.raises(ValueError):
            call()


@needs_kernels
def test_engine_gives_the_same_greedy_tokens_with_and_without_native_kernels(
    make_engine: Callable[..., LLMEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = [[(5 * i + j) % 200 + 3 for j in range(n)] for i, n in enumerate((4, 23, 50))]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    results = []
    for switch in ("1", "0"):
        monkeypatch.setenv("TOLLGATE_NATIVE_KERNELS", switch)
        engine = make_engine()
        results.append([r.token_ids for r in engine.generate(prompts, params)])
    assert results[0] == results[1]
