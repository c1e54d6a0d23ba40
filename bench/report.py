"""What every benchmark shares in how it reports: progress and logs on stderr (stdout is
kept for the table and the final JSON line), percentiles, lists of counts on the command line."""

from __future__ import annotations

import argparse
import sys

import structlog


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def logs_to_stderr() -> None:
    """Sends the log lines of the services' code this process runs (infrastructure
    start and stop, the launcher) to stderr."""
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), interpolated between closest ranks as numpy's default
    is; 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected counts such as 0,1,4, got {text!r}") from None
    if not counts or min(counts) < 0:
        raise argparse.ArgumentTypeError("counts must be whole numbers, 0 or more")
    return counts
