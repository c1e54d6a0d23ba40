"""ctypes bindings of the native kernels (`library.py` builds and loads the library): each
checks what its C function assumes of its tensors, then calls it, typed as kernels.h
declares it (`signatures.py`)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.native.panels import ACTIVATION_BLOCK, GROUP_DEPTH, PANEL_WIDTH
from engine.native.signatures import declared

DecodeKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor
]


class GemmKernel(Protocol):
    def __call__(
        self,
        x: torch.Tensor,
        panels: torch.Tensor,
        bias: torch.Tensor | None,
        out_features: int,
        scale: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


# q, kv_cache, block_index, context_len, block_size, scale, out
PrefillKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, int, int, float, torch.Tensor], None
]

RmsNormKernel = Callable[[torch.Tensor, torch.Tensor, float, torch.Tensor | None], torch.Tensor]
RotaryKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
SiluMulKernel = Callable[[torch.Tensor], torch.Tensor]
# decoder (`engine.models.native_decoder.Decoder`), x, positions, slot mapping, block
# tables, context lengths -> final hidden states
DecodeStepKernel = Callable[
    [ctypes.Structure, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    torch.Tensor,
]


@dataclass(frozen=True, slots=True)
class Kernels:
    paged_decode: DecodeKernel
    prefill_attention: PrefillKernel
    gemm: GemmKernel
    rms_norm: RmsNormKernel
    rotary: RotaryKernel
    silu_mul: SiluMulKernel
    decode_step: DecodeStepKernel
    # Whether `gemm` multiplies integer panels (`pack_integer_panels`): int8 weights by
    # 8-bit activations, with the CPU's integer dot products.
    integer_panels: bool = False


def bind(library: ctypes.CDLL) -> Kernels:
    return Kernels(
        _decode_kernel(library),
        _prefill_kernel(library),
        _gemm_kernel(library),
        _rms_norm_kernel(library),
        _rotary_kernel(library),
        _silu_mul_kernel(library),
        _decode_step_kernel(library),
        integer_panels=bool(declared(library, "tollgate_has_w8a8")()),
    )


def _decode_kernel(library: ctypes.CDLL) -> DecodeKernel:
    function = declared(library, "tollgate_paged_decode")

    def paged_decode(
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        block_size: int,
        scale: float,
    ) -> torch.Tensor:
        """q: [n, H, D] float32, kv_cache: [2, KVH, slots, D] float32 or bfloat16,
        block_tables: [n, max_blocks] int64, context_lens: [n] int64 -> [n, H * D]."""
        # The kernel trusts its pointers: check what it assumes.
        if (
            not supports(q.dtype, kv_cache.dtype)
            or not _is_kv_cache(kv_cache, q.shape[2])
            or q.shape[1] % kv_cache.shape[1] != 0
            or block_tables.dtype != torch.long
            or context_lens.dtype != torch.long
            or not (block_tables.is_contiguous() and context_lens.is_contiguous())
            or not block_tables.shape[0] == q.shape[0] == context_lens.shape[0]
        ):
            raise ValueError("paged_decode: unexpected dtype, layout or shape")
        n, heads, dim = q.shape
        kv_heads, slots = kv_cache.shape[1], kv_cache.shape[2]
        q = q.contiguous()
        out = q.new_empty(n, heads * dim)
        failed = function(
            q.data_ptr(),
            kv_cache.data_ptr(),
            int(kv_cache.dtype == torch.bfloat16),
            block_tables.data_ptr(),
            context_lens.data_ptr(),
            out.data_ptr(),
            n,
            kv_heads,
            heads // kv_heads,
            dim,
            block_size,
            block_tables.shape[1],
            slots,
            scale,
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("native decode attention could not allocate its scratch memory")
        return out

    return paged_decode


def _prefill_kernel(library: ctypes.CDLL) -> PrefillKernel:
    function = declared(library, "tollgate_prefill_attention")

    def prefill_attention(
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_index: torch.Tensor,
        context_len: int,
        block_size: int,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """Causal attention of a sequence's last n positions over its first `context_len`,
        whose keys and values are in the cache: q: [n, H, D] float32 (any row stride),
        kv_cache: [2, KVH, slots, D] float32 or bfloat16, block_index: the sequence's block
        ids (int64), out: [n, H * D] float32 (any row stride), written."""
        n, heads, dim = q.shape
        kv_heads, slots = kv_cache.shape[1], kv_cache.shape[2]
        needed = -(-context_len // block_size)
        if not (
            q.dtype == out.dtype == torch.float32
            and kv_cache.dtype in (torch.float32, torch.bfloat16)
            and q.stride(2) == 1
            and q.stride(1) == dim
            and dim % PANEL_WIDTH == 0
            and _is_kv_cache(kv_cache, dim)
            and heads % kv_heads == 0
            and out.shape == (n, heads * dim)
            and out.stride(1) == 1
            and block_index.dtype == torch.long
            and block_index.dim() == 1
            and block_index.is_contiguous()
            and block_index.shape[0] >= needed
            and 0 <= n <= context_len
        ):
            raise ValueError("prefill_attention: unexpected dtype, layout or shape")
        used = block_index[:needed]
        if needed and not (0 <= int(used.min()) and int(used.max()) < slots // block_size):
            raise ValueError("prefill_attention: a block id lies outside the cache")
        failed = function(
            q.data_ptr(),
            q.stride(0),
            kv_cache.data_ptr(),
            int(kv_cache.dtype == torch.bfloat16),
            block_index.data_ptr(),
            out.data_ptr(),
            out.stride(0),
            n,
            context_len,
            heads,
            kv_heads,
            dim,
            block_size,
            slots,
            scale,
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("native prefill attention could not allocate its scratch memory")

    return prefill_attention


def _is_kv_cache(kv_cache: torch.Tensor, dim: int) -> bool:
    """Whether the attention kernels may read kv_cache as [2, KVH, slots, dim], contiguous:
    keys, then values."""
    return (
        kv_cache.dim() == 4
        and kv_cache.shape[0] == 2
        and kv_cache.shape[3] == dim
        and kv_cache.is_contiguous()
    )


def _gemm_kernel(library: ctypes.CDLL) -> GemmKernel:
    dense, int8, w8a8 = (
        declared(library, name)
        for name in ("tollgate_gemm", "tollgate_gemm_int8", "tollgate_gemm_w8a8")
    )

    def gemm(
        x: torch.Tensor,
        panels: torch.Tensor,
        bias: torch.Tensor | None,
        out_features: int,
        scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: [M, K] float32, panels: [ceil(N / 16), K, 16] (`pack_panels`) float32, or
        int8 with `scale` [N] float32, or integer panels [ceil(N / 16), K / 4, 16, 4]
        (`pack_integer_panels`) uint8 with `scale`, bias: [N] or None -> x @ W^T + bias:
        [M, N], where W = panels' rows (times `scale`, per output feature). Integer panels
        multiply x quantized to 8 bits, one scale per block of 32 of a row's values."""
        integer = panels.dtype == torch.uint8
        in_features = panels.shape[1] * (GROUP_DEPTH if integer else 1)
        if integer and in_features % ACTIVATION_BLOCK:
            raise ValueError(
                f"gemm: integer panels need a depth that is a multiple of {ACTIVATION_BLOCK}"
            )
        quantized = panels.dtype in (torch.int8, torch.uint8)
        shape = (-(-out_features // PANEL_WIDTH), panels.shape[1], PANEL_WIDTH)
        if (
            x.dtype != torch.float32
            or panels.dtype not in (torch.float32, torch.int8, torch.uint8)
            or x.dim() != 2
            or x.shape[1] != in_features
            or tuple(panels.shape) != (shape + (GROUP_DEPTH,) if integer else shape)
            or not panels.is_contiguous()
            or not _is_vector(bias, out_features)
            or (quantized != (scale is not None))
            or not _is_vector(scale, out_features)
        ):
            raise ValueError("gemm: unexpected dtype, layout or shape")
        x = x.contiguous()
        if in_features == 0:  # an empty sum: the loops below would write nothing
            return x.new_zeros(x.shape[0], out_features) + (0 if bias is None else bias)
        out = x.new_empty(x.shape[0], out_features)
        # Held until the call: a pointer into a freed temporary would be read.
        bias = bias.contiguous() if bias is not None else None
        scale = scale.contiguous() if scale is not None else None
        args = (
            x.data_ptr(),
            panels.data_ptr(),
            bias.data_ptr() if bias is not None else None,
            out.data_ptr(),
            x.shape[0],
            out_features,
            in_features,
            torch.get_num_threads(),
        )
        if scale is None:
            dense(*args)
        elif not integer:
            int8(args[0], args[1], scale.data_ptr(), *args[2:])
        elif w8a8(args[0], args[1], scale.data_ptr(), *args[2:]):
            raise MemoryError(
                "native gemm: no scratch memory, or no integer dot products on this CPU"
            )
        return out

    return gemm


def _is_vector(values: torch.Tensor | None, size: int) -> bool:
    """Whether `values` is None or float32 of shape [size]."""
    return values is None or (values.dtype == torch.float32 and values.shape == (size,))


def _rms_norm_kernel(library: ctypes.CDLL) -> RmsNormKernel:
    function = declared(library, "tollgate_rms_norm")

    def rms_norm(
        x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x: [rows, dim] float32, contiguous -> x / rms(x) * weight. With `delta` (x's
        shape), x += delta first, in place."""
        dim = weight.shape[0]
        if not (
            x.dtype == weight.dtype == torch.float32
            and x.dim() == 2
            and x.shape[1] == dim
            and x.is_contiguous()
            and weight.is_contiguous()
        ) or (
            delta is not None
            and not (
                delta.dtype == torch.float32 and delta.shape == x.shape and delta.is_contiguous()
            )
        ):
            raise ValueError("rms_norm: unexpected dtype, layout or shape")
        out = torch.empty_like(x)
        function(
            x.data_ptr(),
            delta.data_ptr() if delta is not None else None,
            weight.data_ptr(),
            out.data_ptr(),
            x.shape[0],
            dim,
            eps,
            torch.get_num_threads(),
        )
        return out

    return rms_norm


def _rotary_kernel(library: ctypes.CDLL) -> RotaryKernel:
    function = declared(library, "tollgate_rotary")

    def rotary(
        x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        """Rotates x: [T, heads, D] float32 (any row stride) in place by the angles of
        `positions` [T] int64, all below len(cos); cos, sin: [*, D / 2] float32."""
        rows, heads, dim = x.shape
        if not (
            x.dtype == cos.dtype == sin.dtype == torch.float32
            and x.stride(2) == 1
            and x.stride(1) == dim
            and dim % 2 == 0
            and positions.dtype == torch.long
            and positions.shape == (rows,)
            and positions.is_contiguous()
            and cos.shape == sin.shape
            and cos.shape[1] == dim // 2
            and cos.is_contiguous()
            and sin.is_contiguous()
        ):
            raise ValueError("rotary: unexpected dtype, layout or shape")
        if rows and not (0 <= int(positions.min()) and int(positions.max()) < cos.shape[0]):
            raise ValueError("rotary: a position lies outside the cos/sin tables")
        function(
            x.data_ptr(),
            rows,
            x.stride(0),
            heads,
            dim,
            positions.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            torch.get_num_threads(),
        )

    return rotary


def _silu_mul_kernel(library: ctypes.CDLL) -> SiluMulKernel:
    function = declared(library, "tollgate_silu_mul")

    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [rows, 2 * I] float32, contiguous -> silu(gate) * up: [rows, I]."""
        if not (
            gate_up.dtype == torch.float32
            and gate_up.dim() == 2
            and gate_up.shape[1] % 2 == 0
            and gate_up.is_contiguous()
        ):
            raise ValueError("silu_mul: unexpected dtype, layout or shape")
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = gate_up.new_empty(rows, width)
        function(gate_up.data_ptr(), out.data_ptr(), rows, width, torch.get_num_threads())
        return out

    return silu_mul


def _decode_step_kernel(library: ctypes.CDLL) -> DecodeStepKernel:
    function = declared(library, "tollgate_decode_step")

    def decode_step(
        decoder: ctypes.Structure,
        x: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> torch.Tensor:
        """Every layer and the final norm for rows that each add one token to a sequence:
        x: [n, hidden] float32 token embeddings (overwritten: the residual stream),
        positions, slot_mapping, context_lens: [n] int64, block_tables: [n, max_blocks]
        int64 -> the final hidden states [n, hidden]. The decoder's weights, caches and
        tables are trusted (`engine.models.native_decoder` builds it from a model); the
        positions must lie in its rotary tables, the slots and blocks in its caches."""
        rows = x.shape[0]
        vectors = (positions, slot_mapping, context_lens)
        if not (
            x.dtype == torch.float32
            and x.dim() == 2
            and x.shape[1] == decoder.hidden
            and x.is_contiguous()
            and all(v.dtype == torch.long and v.shape == (rows,) for v in vectors)
            and all(v.is_contiguous() for v in vectors)
            and block_tables.dtype == torch.long
            and block_tables.dim() == 2
            and block_tables.shape[0] == rows
            and block_tables.is_contiguous()
        ):
            raise ValueError("decode_step: unexpected dtype, layout or shape")
        out = torch.empty_like(x)
        if function(
            ctypes.byref(decoder),
            x.data_ptr(),
            rows,
            positions.data_ptr(),
            slot_mapping.data_ptr(),
            block_tables.data_ptr(),
            context_lens.data_ptr(),
            block_tables.shape[1],
            out.data_ptr(),
            torch.get_num_threads(),
        ):
            raise MemoryError("native decode step: no scratch memory")
        return out

    return decode_step


def supports(dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    """Whether the decode kernel takes this model dtype and KV cache dtype."""
    return dtype == torch.float32 and kv_dtype in (torch.float32, torch.bfloat16)


def supports_prefill(dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the prefill kernel takes them. It reads the chunk's own keys and values back
    from the cache, so with a bfloat16 cache it sees them rounded, as decode steps do (the
    PyTorch path attends to the chunk's exact ones)."""
    return (
        dtype == torch.float32
        and kv_dtype in (torch.float32, torch.bfloat16)
        and head_dim % PANEL_WIDTH == 0
    )
