"""Buffers on transparent huge pages: the same values as ordinary ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import huge_pages


def test_zeros_are_zeros_of_the_shape_and_dtype_asked() -> None:
    buffer = huge_pages.zeros(2, 3, 1 << 19, dtype=torch.bfloat16)
    assert buffer.shape == (2, 3, 1 << 19) and buffer.dtype == torch.bfloat16
    assert not buffer.any()


def test_a_buffer_without_a_whole_huge_page_is_left_alone() -> None:
    assert huge_pages.advise(torch.empty(1000)) is False


@pytest.mark.skipif(
    not Path("/sys/kernel/mm/transparent_hugepage").exists(),
    reason="this kernel has no transparent huge pages",
)
def test_a_kernel_with_huge_pages_accepts_the_advice_for_a_large_buffer() -> None:
    # Accepted whatever the machine's setting (never, madvise, always).
    assert huge_pages.advise(torch.empty(8 << 20)) is True
