"""bench.quant's quality measures on hand-made inputs."""

from __future__ import annotations

import argparse

import pytest

from bench.quant import PROSE, PromptSet, common_prefix, exact_match, prose_prompts
from bench.report import counts


def test_exact_match_and_common_prefix() -> None:
    reference = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert exact_match(reference, reference) == 1.0 == common_prefix(reference, reference)
    outputs = [[1, 2, 9, 9], [5, 6, 7, 8]]
    assert exact_match(outputs, reference) == 0.5
    assert common_prefix(outputs, reference) == (2 / 4 + 1) / 2
    assert common_prefix([[0, 2, 3, 4], [5, 6, 7, 8]], reference) == 0.5


def test_prompts_are_seeded_windows_of_the_shipped_text() -> None:
    assert len(PROSE.read_text().split()) > 2000
    text = list(range(3000))
    prompts = prose_prompts(text, PromptSet(8, (10, 20), 5), seed=3)
    assert prompts == prose_prompts(text, PromptSet(8, (10, 20), 5), seed=3)
    for window in prompts.prompts:
        assert 10 <= len(window) <= 20
        assert window == list(range(window[0], window[0] + len(window)))
    assert prompts.output_lens == [5] * 8


def test_counts_on_the_command_line() -> None:
    assert counts("1,16,64") == [1, 16, 64]
    for bad in ("", "a,b", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            counts(bad)
