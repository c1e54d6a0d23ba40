"""Buffers on transparent huge pages: the same values as ordinary ones."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import huge_pages
from engine.llm_engine import LLMEngine

HAS_THP = Path("/sys/kernel/mm/transparent_hugepage").exists()
HUGE_PAGE = 2 << 20


def test_zeros_are_zeros_of_the_shape_and_dtype_asked() -> None:
    buffer = huge_pages.zeros(2, 3, 1 << 19, dtype=torch.bfloat16)
    assert buffer.shape == (2, 3, 1 << 19) and buffer.dtype == torch.bfloat16
    assert not buffer.any()


def test_a_buffer_without_a_whole_huge_page_is_left_alone() -> None:
    assert huge_pages.advise(torch.empty(1000)) is False


@pytest.mark.skipif(not HAS_THP, reason="this kernel has no transparent huge pages")
def test_a_kernel_with_huge_pages_accepts_the_advice_for_a_large_buffer() -> None:
    # Accepted whatever the machine's setting (never, madvise, always).
    assert huge_pages.advise(torch.empty(8 << 20)) is True


def _vm_flags(address: int) -> set[str]:
    """The VmFlags of this process's mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split(maxsplit=1)[0]
        if "-" in first and not first.endswith(":"):  # a mapping's range: start-end
            start, end = (int(bound, 16) for bound in first.split("-"))
            inside = start <= address < end
        elif inside and first == "VmFlags:":
            return set(line.split()[1:])
    return set()


@pytest.mark.skipif(not HAS_THP, reason="this kernel has no transparent huge pages")
def test_the_engine_asks_huge_pages_for_its_kv_cache(
    make_engine: Callable[..., LLMEngine],
) -> None:
    engine = make_engine(num_kv_blocks=4096)
    for cache in engine.runner.kv_caches:
        first_page = -(-cache.data_ptr() // HUGE_PAGE) * HUGE_PAGE
        assert first_page + HUGE_PAGE <= cache.data_ptr() + cache.numel() * cache.element_size()
        assert "hg" in _vm_flags(first_page)  # advised MADV_HUGEPAGE
    # An ordinary tensor of the same size is not.
    plain = torch.zeros(engine.runner.kv_caches[0].shape)
    assert "hg" not in _vm_flags(-(-plain.data_ptr() // HUGE_PAGE) * HUGE_PAGE)
