"""Native kernels: small C functions built with the system's C compiler on first use.

* `paged_decode` (`paged_decode.c`): decode attention that reads each sequence's keys and
  values where they lie in the paged cache; the PyTorch path copies them into a padded
  batch first.
* `prefill_attention` (`prefill_attention.c`): causal attention of a prompt chunk over
  its sequence's cached positions, with the matrix multiply's register tiles.
* `gemm` (`gemm.c`): the matrix multiply of linear layers whose weights are packed in
  panels (`panels.py`, `engine.layers.linear.PanelLinear`).
* `rms_norm`, `rotary` and `silu_mul` (`pointwise.c`): RMS norm (with the residual add
  before it), rotary embeddings and SiLU gating, each in one pass over its rows.
* `decode_step` (`decode_step.c`): every layer of a decode-only step in one call, the
  kernels above back to back (`engine.models.native_decoder`).

All live in one shared library (`library.py` builds, caches and loads it). `kernels.h`
declares its functions once: the compiler checks each definition against it, and
`bindings.py` types each call from it (`signatures.py`).
"""

from engine.native.bindings import (
    DecodeKernel,
    DecodeStepKernel,
    GemmKernel,
    Kernels,
    PrefillKernel,
    RmsNormKernel,
    RotaryKernel,
    SiluMulKernel,
    supports,
    supports_prefill,
)
from engine.native.library import (
    build,
    enabled,
    for_tensors,
    gemm,
    kernels,
    load,
    paged_decode,
    prefill_attention,
)
from engine.native.panels import (
    ACTIVATION_BLOCK,
    GROUP_DEPTH,
    PANEL_WIDTH,
    pack_integer_panels,
    pack_panels,
    panel_rows,
)

__all__ = [
    "ACTIVATION_BLOCK",
    "GROUP_DEPTH",
    "PANEL_WIDTH",
    "DecodeKernel",
    "DecodeStepKernel",
    "GemmKernel",
    "Kernels",
    "PrefillKernel",
    "RmsNormKernel",
    "RotaryKernel",
    "SiluMulKernel",
    "build",
    "enabled",
    "for_tensors",
    "gemm",
    "kernels",
    "load",
    "pack_integer_panels",
    "pack_panels",
    "panel_rows",
    "paged_decode",
    "prefill_attention",
    "supports",
    "supports_prefill",
]
