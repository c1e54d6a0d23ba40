"""Linear layers packed for the native kernel or for oneDNN compute what the plain ones compute."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine import native
from engine.layers.linear import (
    Embedding,
    Linear,
    PackedLinear,
    PanelLinear,
    can_pack,
    pack_linear_layers,
)

HAS_ONEDNN = can_pack(torch.empty(1))
GEMM = native.gemm()
needs_onednn = pytest.mark.skipif(not HAS_ONEDNN, reason="this PyTorch build has no oneDNN linear")
needs_gemm = pytest.mark.skipif(GEMM is None, reason="the native kernels did not build here")


def _panel_linear(layer: Linear) -> nn.Module:
    assert GEMM is not None
    return PanelLinear(layer, GEMM)


PACKINGS = [
    pytest.param(PackedLinear, marks=needs_onednn, id="onednn"),
    pytest.param(_panel_linear, marks=needs_gemm, id="panels"),
]


def _linear(rows: int, cols: int, bias: bool, seed: int = 0) -> Linear:
    generator = torch.Generator().manual_seed(seed)
    layer = Linear(cols, rows, bias=bias)
    layer.weight.data = torch.randn(rows, cols, generator=generator)
    if layer.bias is not None:
        layer.bias.data = torch.randn(rows, generator=generator)
    return layer


@pytest.mark.parametrize("pack", PACKINGS)
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_layer_matches_the_plain_product(
    pack: Callable[[Linear], nn.Module], bias: bool
) -> None:
    layer = _linear(300, 64, bias)
    packed = pack(layer)
    wide = torch.randn(40, 128)
    for x in (torch.randn(0, 64), torch.randn(1, 64), wide[:37, ::2], torch.randn(2, 5, 64)):
        expected = F.linear(x, layer.weight, layer.bias)
        got = packed(x)
        assert got.shape == expected.shape
        assert torch.allclose(got, expected, atol=1e-4, rtol=1e-5), (got - expected).abs().max()


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = Embedding(50, 16)
        self.embed.weight.data = torch.randn(50, 16)
        self.proj = _linear(16, 16, bias=True)
        self.bf16 = Linear(16, 16, dtype=torch.bfloat16)
        self.head = Linear(16, 50)
        self.head.weight = self.embed.weight


@pytest.mark.parametrize(
    ("native_kernels", "packed_type", "buffer"),
    [
        pytest.param("1", PanelLinear, "panels", marks=needs_gemm, id="panels"),
        pytest.param("0", PackedLinear, "packed", marks=needs_onednn, id="onednn"),
    ],
)
def test_packing_replaces_the_fp32_layers_and_leaves_the_rest(
    monkeypatch: pytest.MonkeyPatch, native_kernels: str, packed_type: type, buffer: str
) -> None:
    monkeypatch.setenv("TOLLGATE_NATIVE_KERNELS", native_kernels)
    model = _Tiny()
    embedding = model.embed.weight.detach().clone()
    x = torch.randn(3, 16)
    expected_proj, expected_head = model.proj(x), model.head(x)

    assert pack_linear_layers(model) == 1
    assert isinstance(model.proj, packed_type)
    # Packing the tied head would copy the embedding; the bf16 layer cannot be packed.
    assert isinstance(model.head, Linear) and model.head.weight is model.embed.weight
    assert isinstance(model.bf16, Linear)
    # The packed weight is a buffer of the model: its size still counts.
    assert dict(model.proj.named_buffers())[buffer].numel() == 16 * 16
    assert torch.equal(model.embed.weight, embedding)
    assert torch.allclose(model.proj(x), expected_proj, atol=1e-5)
    assert torch.allclose(model.head(x), expected_head, atol=1e-5)
    assert pack_linear_layers(model) == 0
