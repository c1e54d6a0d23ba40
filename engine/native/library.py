"""The native kernels' shared library: compiled from the sources beside this file with the
system's C compiler on first use, cached under `$TOLLGATE_KERNEL_CACHE` (default
`~/.cache/tollgate/kernels`), keyed by the sources, the compiler command and the CPU, and
loaded with its functions bound (`bindings.py`). Without a working compiler, or with
`TOLLGATE_NATIVE_KERNELS=0`, `kernels()` returns None and the engine computes all of this
in PyTorch.
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
from pathlib import Path

import torch

from engine.config import switched_on
from engine.native.bindings import DecodeKernel, GemmKernel, Kernels, PrefillKernel, bind
from engine.user_cache import user_cache

log = logging.getLogger(__name__)

SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in ("paged_decode.c", "prefill_attention.c", "gemm.c", "pointwise.c", "decode_step.c")
)
# Included by the sources: part of what a cached library was built from.
HEADERS = tuple(Path(__file__).with_name(name) for name in ("simd.h", "kernels.h"))
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


def enabled() -> bool:
    return switched_on("TOLLGATE_NATIVE_KERNELS")


def cache_dir() -> Path:
    return user_cache("kernels", "TOLLGATE_KERNEL_CACHE")


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
                *(source.read_bytes() for source in SOURCES + HEADERS),
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
    return bind(ctypes.CDLL(str(path)))


def kernels() -> Kernels | None:
    """This process's native kernels, or None when they are off or unavailable."""
    return _built_kernels() if enabled() else None


def for_tensors(*tensors: torch.Tensor | None) -> Kernels | None:
    """The native kernels, when they are on and each tensor given is contiguous float32 in
    CPU memory."""
    if all(t is None or _is_plain_cpu_float(t) for t in tensors):
        return kernels()
    return None


def _is_plain_cpu_float(tensor: torch.Tensor) -> bool:
    return tensor.dtype == torch.float32 and tensor.device.type == "cpu" and tensor.is_contiguous()


def paged_decode() -> DecodeKernel | None:
    """The decode kernel for this process, or None when native kernels are off or unavailable."""
    built = kernels()
    return built.paged_decode if built else None


def prefill_attention() -> PrefillKernel | None:
    """The prefill attention kernel, or None when native kernels are off or unavailable."""
    built = kernels()
    return built.prefill_attention if built else None


def gemm() -> GemmKernel | None:
    """The packed-weight matrix multiply, or None when native kernels are off or unavailable."""
    built = kernels()
    return built.gemm if built else None


@functools.cache
def _built_kernels() -> Kernels | None:
    path = build()
    return load(path) if path else None


def _cpu_identity() -> bytes:
    """The CPU's feature flags (the library is built for this CPU)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.encode()
    except OSError:
        pass
    return platform.machine().encode() + platform.processor().encode()
