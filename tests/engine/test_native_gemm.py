"""The native matrix multiply of packed linear layers against PyTorch's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import native
from engine.native import library

GEMM = native.gemm()
needs_kernel = pytest.mark.skipif(GEMM is None, reason="the native kernels did not build here")


def _weights(out_features: int, in_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator)
    return weight, torch.randn(out_features, generator=generator)


def test_panels_hold_sixteen_output_features_each_padded_with_zeros() -> None:
    weight = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)
    panels = native.pack_panels(weight)
    assert panels.shape == (2, 3, 16)
    assert torch.equal(panels[0, 2], weight[:16, 2])
    assert torch.equal(panels[1, 1, :4], weight[16:, 1])
    assert not panels[1, :, 4:].any()


# Rows: one, a tile and a part (6 + 1), past one row block (128); features: a panel and a
# part, and enough panels (70) that threads share them in chunks of several, the last one
# shorter; depth: odd, and past one column block (512).
@needs_kernel
@pytest.mark.parametrize("rows", [0, 1, 7, 64, 131])
@pytest.mark.parametrize(
    ("out_features", "in_features"), [(16, 8), (37, 65), (48, 1100), (1110, 70)]
)
@pytest.mark.parametrize("bias", [False, True])
def test_the_product_matches_pytorch(
    rows: int, out_features: int, in_features: int, bias: bool
) -> None:
    assert GEMM is not None
    weight, b = _weights(out_features, in_features, seed=rows)
    x = torch.randn(rows, in_features)
    expected = F.linear(x.double(), weight.double(), b.double() if bias else None)
    got = GEMM(x, native.pack_panels(weight), b if bias else None, out_features)
    assert got.shape == (rows, out_features)
    assert torch.allclose(got.double(), expected, atol=1e-4, rtol=1e-5)


@needs_kernel
def test_a_strided_input_is_read_as_its_values() -> None:
    assert GEMM is not None
    weight, _ = _weights(20, 32, seed=1)
    wide = torch.randn(9, 64)
    assert torch.allclose(
        GEMM(wide[:, ::2], native.pack_panels(weight), None, 20),
        wide[:, ::2] @ weight.t(),
        atol=1e-5,
    )


@needs_kernel
def test_each_thread_count_gives_the_same_product() -> None:
    assert GEMM is not None
    weight, b = _weights(200, 96, seed=2)
    panels, x = native.pack_panels(weight), torch.randn(30, 96)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = GEMM(x, panels, b, 200)
        torch.set_num_threads(3)
        several = GEMM(x, panels, b, 200)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, several)


@needs_kernel
def test_a_build_without_openmp_computes_the_same(tmp_path: Path) -> None:
    assert GEMM is not None
    single = native.load(library._build(["cc"], library.FLAGS, tmp_path)).gemm
    weight, b = _weights(40, 70, seed=3)
    panels, x = native.pack_panels(weight), torch.randn(13, 70)
    assert torch.equal(single(x, panels, b, 40), GEMM(x, panels, b, 40))


@needs_kernel
def test_the_kernel_refuses_inputs_it_would_misread() -> None:
    assert GEMM is not None
    weight, b = _weights(20, 8, seed=4)
    panels, x = native.pack_panels(weight), torch.randn(3, 8)
    assert GEMM(x, panels, b, 20).shape == (3, 20)
    bad = [
        (x.double(), panels, b, 20),
        (torch.randn(3, 9), panels, b, 20),  # depth differs from the weight's
        (x, panels, b, 40),  # more features than the panels hold
        (x, panels.transpose(1, 2), b, 20),
        (x, native.pack_panels(torch.randn(20, 16))[:, ::2], b, 20),  # the right shape, strided
        (x, panels, b[:10], 20),
        (x, panels, b.double(), 20),
        (x.unsqueeze(0), panels, b, 20),
    ]
    for args in bad:
        with pytest.raises(ValueError):
            GEMM(*args)


def test_the_kernels_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOLLGATE_NATIVE_KERNELS", "0")
    assert native.gemm() is None and native.kernels() is None


@needs_kernel
@pytest.mark.parametrize("rows", [1, 7, 131])
def test_int8_panels_multiply_as_their_widened_weight_times_its_scale(rows: int) -> None:
    assert GEMM is not None
    generator = torch.Generator().manual_seed(rows)
    qweight = torch.randint(-127, 128, (37, 1100), generator=generator, dtype=torch.int8)
    # Weights of about the size a trained layer has: |q * scale| <= 1.27.
    scale = torch.rand(37, generator=generator) * 0.01
    bias = torch.randn(37, generator=generator)
    x = torch.randn(rows, 1100, generator=generator)
    expected = F.linear(x.double(), qweight.double() * scale.double().unsqueeze(1), bias.double())
    got = GEMM(x, native.pack_panels(qweight), bias, 37, scale)
    assert torch.allclose(got.double(), expected, atol=1e-3, rtol=1e-5)


needs_integer_panels = pytest.mark.skipif(
    not (native.kernels() and native.kernels().integer_panels),  # type: ignore[union-attr]
    reason="this CPU has no integer dot products (AVX-512 VNNI)",
)


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the integer panels' kernel reads it: each block of 32 of a row's values rounded
    to 8 bits of its own scale (its largest magnitude over 127), as floats."""
    blocks = x.reshape(x.shape[0], -1, native.ACTIVATION_BLOCK)
    scale = blocks.abs().amax(dim=2, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (torch.round(blocks * (1 / scale)).clamp(-127, 127) * scale).reshape(x.shape)


@needs_integer_panels
@pytest.mark.parametrize("rows", [1, 7, 9, 131])
@pytest.mark.parametrize("out_features", [16, 37])
def test_integer_panels_multiply_8_bit_activations_by_the_weight_times_its_scale(
    rows: int, out_features: int
) -> None:
    assert GEMM is not None
    generator = torch.Generator().manual_seed(rows * out_features)
    depth = 34 * native.ACTIVATION_BLOCK
    qweight = torch.randint(-127, 128, (out_features, depth), generator=generator, dtype=torch.int8)
    scale = torch.rand(out_features, generator=generator) * 0.01
    bias = torch.randn(out_features, generator=generator)
    x = torch.randn(rows, depth, generator=generator) * 3
    x[0, :32] = 0  # a zero block keeps a scale of 1
    x[-1, 64:96] *= 1000  # an outlier block costs the others nothing
    weight = qweight.double() * scale.double().unsqueeze(1)
    expected = F.linear(quantized_activations(x).double(), weight, bias.double())
    got = GEMM(x, native.pack_integer_panels(qweight), bias, out_features, scale)
    assert torch.allclose(got.double(), expected, atol=1e-3, rtol=1e-5)
    # And within the rounding of 8-bit activations of the product in full precision.
    exact = F.linear(x.double(), weight, bias.double())
    steps = x.reshape(rows, -1, native.ACTIVATION_BLOCK).abs().amax(dim=2).double() / 127
    halves = steps.repeat_interleave(native.ACTIVATION_BLOCK, dim=1) / 2  # [rows, depth]
    bound = halves @ weight.abs().T
    assert ((got.double() - exact).abs() <= bound + 1e-3).all()


@needs_integer_panels
def test_integer_panels_hold_the_int8_rows_they_were_packed_from() -> None:
    qweight = torch.randint(-127, 128, (37, 64), dtype=torch.int8)
    panels = native.pack_integer_panels(qweight)
    assert panels.dtype == torch.uint8 and tuple(panels.shape) == (3, 16, 16, 4)
    rows = torch.tensor([0, 15, 16, 36])
    assert torch.equal(native.panel_rows(panels, rows), qweight[rows])
    assert torch.equal(native.panel_rows(native.pack_panels(qweight), rows), qweight[rows])
    with pytest.raises(ValueError):
        native.pack_integer_panels(torch.zeros(4, 48, dtype=torch.int8))
    with pytest.raises(ValueError):  # a uint8 matrix needs integer panels' shape
        GEMM(torch.randn(2, 64), panels.view(3, 64, 16), None, 37, torch.ones(37))  # type: ignore[misc]


@needs_kernel
def test_int8_panels_need_a_scale_and_float_panels_take_none() -> None:
    assert GEMM is not None
    x, weight = torch.randn(2, 8), torch.randn(20, 8)
    with pytest.raises(ValueError):
        GEMM(x, native.pack_panels(weight.to(torch.int8)), None, 20)
    with pytest.raises(ValueError):
        GEMM(x, native.pack_panels(weight), None, 20, torch.ones(20))
    with pytest.raises(ValueError):
        GEMM(x, native.pack_panels(weight.to(torch.int8)), None, 20, torch.ones(19))


@needs_kernel
def test_a_product_over_no_inputs_is_the_bias() -> None:
    assert GEMM is not None
    bias = torch.randn(20)
    got = GEMM(torch.empty(3, 0), native.pack_panels(torch.empty(20, 0)), bias, 20)
    assert torch.equal(got, bias.expand(3, 20))
