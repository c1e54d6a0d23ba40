"""Large buffers on transparent huge pages, where the kernel offers them on request.

The KV cache is read in blocks of a few KB at scattered places; on 4 KB pages nearly every
block costs a TLB miss. Linux with transparent huge pages in `madvise` mode (a common
default) backs a region with 2 MB pages only when asked, before its memory is first
touched. Elsewhere, or when asking fails, buffers are ordinary memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from collections.abc import Callable

import torch

_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(*shape, dtype=dtype), on huge pages where the OS allows."""
    buffer = torch.empty(*shape, dtype=dtype)
    advise(buffer)
    return buffer.zero_()


def advise(buffer: torch.Tensor) -> bool:
    """Asks for huge pages over the 2 MB-aligned part of `buffer`'s memory; returns whether
    the OS accepted. Only pages not touched yet are affected."""
    madvise = _madvise()
    start = -(-buffer.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
    end = (buffer.data_ptr() + buffer.numel() * buffer.element_size()) // _HUGE_PAGE * _HUGE_PAGE
    if madvise is None or end <= start:
        return False
    return madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE) == 0


@functools.cache
def _madvise() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return function
