"""The checks made on what a client sends before it reaches SQL."""

import math

from services.core.validation import (
    MAX_SHOWN,
    duration_seconds,
    is_identifier,
    seq_violation,
    shown,
    text_violation,
    timestamp_violation,
)


def test_identifiers_are_what_tollgate_issues() -> None:
    issued = ["run_0f3a", "ten_9c1d2e", "0123456789abcdef", "run_1:output_tokens", "t-1.2"]
    assert all(is_identifier(value) for value in issued)
    refused = ["", "a\x00b", "x" * 129, "run é", "run/1", "a b"]
    assert not any(is_identifier(value) for value in refused)


def test_shown_values_are_short_ascii() -> None:
    assert shown("run_1") == "'run_1'"
    long = shown("é" * 20_000)
    assert long.isascii() and "20000 characters" in long
    assert len(long) < 8 * MAX_SHOWN


def test_text_is_printable_and_bounded() -> None:
    assert text_violation("name", "Acme Corp ü", 200) is None
    for bad in ("a\x00b", "tab\t", "line\n", "x" * 201):
        violation = text_violation("name", bad, 200)
        assert violation is not None and violation.field == "name"


def test_durations_and_timestamps_out_of_range() -> None:
    assert duration_seconds(1, 500_000_000) == 1.5
    assert duration_seconds(-1, -500_000_000) == -1.5
    assert duration_seconds(0, 0) == 0.0
    assert duration_seconds(1, -1) is None and duration_seconds(0, 10**9) is None
    huge = duration_seconds(10**15, 0)
    assert huge is not None and math.isfinite(huge)
    assert timestamp_violation("start_time", 0, 0) is None
    assert timestamp_violation("start_time", 253_402_300_800, 0) is not None
    assert timestamp_violation("start_time", 0, -1) is not None
    assert seq_violation("starting_after", 2**63 - 1) is None
    assert seq_violation("starting_after", 2**63) is not None
