"""Native kernels: small C functions built with the system's C compiler on first use.

* `paged_decode` (`paged_decode.c`): decode attention that reads each sequence's keys and
  values where they lie in the paged cache; the PyTorch path copies them into a padded
  batch first.
* `gemm` (`gemm.c`): the matrix multiply of linear layers whose weights are packed in
  panels (`engine.layers.linear.PanelLinear`).

Both live in one shared library, cached under `$TOLLGATE_KERNEL_CACHE` (default
`~/.cache/tollgate/kernels`), keyed by the sources, the compiler command and the CPU.
Without a working compiler, or with `TOLLGATE_NATIVE_KERNELS=0`, `kernels()` returns None
and attention and linear layers stay in PyTorch.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("paged_decode.c", "gemm.c"))
# Reassociation lets the compiler vectorize the dot products. Not -ffast-math: linked into
# a shared library it flushes subnormal floats to zero for the whole process on loading.
FLAGS = (
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-ffp-contract=fast",
    "-fPIC",
    "-shared",
)
# q, cache, cache is bf16, block tables, context lengths, out, then the sizes (n, kv heads,
# group, dim, block size, max blocks, slots), scale and threads.
_DECODE_SIGNATURE: list[type[ctypes.c_void_p | ctypes.c_int | ctypes.c_int64 | ctypes.c_float]] = [
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_void_p,
    *[ctypes.c_int64] * 7,
    ctypes.c_float,
    ctypes.c_int,
]

# x, panels, bias, y, then M, N, K and threads.
_GEMM_SIGNATURE: list[type[ctypes.c_void_p | ctypes.c_int | ctypes.c_int64]] = [
    *[ctypes.c_void_p] * 4,
    *[ctypes.c_int64] * 3,
    ctypes.c_int,
]

DecodeKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor
]
GemmKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, int], torch.Tensor]
# Output features per panel of a packed weight (NR in gemm.c).
PANEL_WIDTH = 16


@dataclass(frozen=True, slots=True)
class Kernels:
    paged_decode: DecodeKernel
    gemm: GemmKernel


_OFF = ("0", "false", "no", "off")


def enabled() -> bool:
    return os.environ.get("TOLLGATE_NATIVE_KERNELS", "1").strip().lower() not in _OFF


def cache_dir() -> Path:
    configured = os.environ.get("TOLLGATE_KERNEL_CACHE")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tollgate" / "kernels"


def build(compiler: str | None = None, directory: Path | None = None) -> Path | None:
    """The compiled library's path (compiling it when not cached), or None when it fails.

    Built with OpenMP where the compiler has it; otherwise the kernel runs on one thread.
    """
    command = shlex.split(compiler or os.environ.get("CC") or "cc")
    directory = directory or cache_dir()
    errors = []
    for flags in (FLAGS + ("-fopenmp",), FLAGS):
        try:
            return _build(command, flags, directory)
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            errors.append(f"{exc} {detail.decode(errors='replace').strip()[:300]}")
    log.warning("native kernels unavailable, using PyTorch: %s", " | ".join(errors))
    return None


def _build(command: list[str], flags: tuple[str, ...], directory: Path) -> Path:
    key = hashlib.sha256(
        b"\0".join(
            [
                *(source.read_bytes() for source in SOURCES),
                " ".join(command + list(flags)).encode(),
                _cpu_identity(),
            ]
        )
    ).hexdigest()[:16]
    target = directory / f"kernels-{key}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    # Compile beside the target and rename: processes building at once never load a
    # half-written library.
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        partial = Path(scratch) / target.name
        subprocess.run(
            [*command, *flags, *map(str, SOURCES), "-o", str(partial), "-lm"],
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.replace(partial, target)
    return target


def load(path: Path) -> Kernels:
    library = ctypes.CDLL(str(path))
    return Kernels(_decode_kernel(library), _gemm_kernel(library))


def _decode_kernel(library: ctypes.CDLL) -> DecodeKernel:
    function = library.tollgate_paged_decode
    function.restype = ctypes.c_int
    function.argtypes = _DECODE_SIGNATURE

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
            or q.shape[2] != kv_cache.shape[3]
            or q.shape[1] % kv_cache.shape[1] != 0
            or not kv_cache.is_contiguous()
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


def _gemm_kernel(library: ctypes.CDLL) -> GemmKernel:
    function = library.tollgate_gemm
    function.restype = None
    function.argtypes = _GEMM_SIGNATURE

    def gemm(
        x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int
    ) -> torch.Tensor:
        """x: [M, K] float32, panels: [ceil(N / 16), K, 16] float32 (`pack_panels`),
        bias: [N] or None -> x @ W^T + bias: [M, N]."""
        in_features = panels.shape[1]
        if (
            x.dtype != torch.float32
            or panels.dtype != torch.float32
            or x.dim() != 2
            or x.shape[1] != in_features
            or tuple(panels.shape) != (-(-out_features // PANEL_WIDTH), in_features, PANEL_WIDTH)
            or not panels.is_contiguous()
            or (bias is not None and (bias.dtype != torch.float32 or bias.shape != (out_features,)))
        ):
            raise ValueError("gemm: unexpected dtype, layout or shape")
        x = x.contiguous()
        out = x.new_empty(x.shape[0], out_features)
        if bias is not None:
            bias = bias.contiguous()
        function(
            x.data_ptr(),
            panels.data_ptr(),
            bias.data_ptr() if bias is not None else None,
            out.data_ptr(),
            x.shape[0],
            out_features,
            in_features,
            torch.get_num_threads(),
        )
        return out

    return gemm


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> panels [ceil(N / 16), K, 16] for `gemm`: panels[p, k, j] = W[16p + j, k],
    rows past N zero."""
    out_features, in_features = weight.shape
    num_panels = -(-out_features // PANEL_WIDTH)
    padded = weight.new_zeros(num_panels * PANEL_WIDTH, in_features)
    padded[:out_features] = weight
    return padded.view(num_panels, PANEL_WIDTH, in_features).transpose(1, 2).contiguous()


def kernels() -> Kernels | None:
    """This process's native kernels, or None when they are off or unavailable."""
    return _built_kernels() if enabled() else None


def paged_decode() -> DecodeKernel | None:
    """The decode kernel for this process, or None when native kernels are off or unavailable."""
    built = kernels()
    return built.paged_decode if built else None


def gemm() -> GemmKernel | None:
    """The packed-weight matrix multiply, or None when native kernels are off or unavailable."""
    built = kernels()
    return built.gemm if built else None


@functools.cache
def _built_kernels() -> Kernels | None:
    path = build()
    return load(path) if path else None


def supports(dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    return dtype == torch.float32 and kv_dtype in (torch.float32, torch.bfloat16)


def _cpu_identity() -> bytes:
    """The CPU's feature flags (the library is built for this CPU)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.encode()
    except OSError:
        pass
    return platform.machine().encode() + platform.processor().encode()
