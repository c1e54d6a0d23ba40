"""Printing a run's stream: text as it arrives, or one JSON object per event."""

from __future__ import annotations

import sys
from typing import TextIO

from tollgate.commands.output import event_dict, json_line
from tollgate.stream import Stream


def print_stream(stream: Stream, *, as_json: bool, out: TextIO | None = None) -> int:
    """Prints the stream to its end; 0 when the run completed, 1 when it failed or was cancelled."""
    out = out or sys.stdout
    with stream:
        for event in stream:
            if as_json:
                out.write(json_line(event_dict(event)) + "\n")
            elif event.text:
                out.write(event.text)
            out.flush()
    if not as_json and stream.text and not stream.text.endswith("\n"):
        out.write("\n")
        out.flush()
    # Raises RunFailedError / RunCancelledError, which the command reports.
    stream.raise_for_outcome()
    return 0
