"""Checks on what a client sends, made before any of it reaches SQL (no I/O).

PostgreSQL refuses text holding U+0000 and rows too large for an index, and its bigint
and timestamp types have ranges protobuf's do not: a value past any of these would
otherwise surface as an internal error, or as a retryable "database away".
"""

from __future__ import annotations

import math
import re

from services.core.errors import FieldViolation, NotFound

# Every id Tollgate issues (run_…, ten_…, hex key ids, entry ids "<run_id>:<type>") fits.
MAX_ID_LENGTH = 128
_ID = re.compile(rf"[A-Za-z0-9._:-]{{1,{MAX_ID_LENGTH}}}")
# How much of a client's value an error message repeats.
MAX_SHOWN = 64
MAX_SEQ = 2**63 - 1  # the store's seq is a bigint
# google.protobuf.Timestamp's range: 0001-01-01T00:00:00Z to 9999-12-31T23:59:59Z.
MIN_TIMESTAMP_SECONDS = -62_135_596_800
MAX_TIMESTAMP_SECONDS = 253_402_300_799
NANOS_PER_SECOND = 1_000_000_000


def is_identifier(value: str) -> bool:
    """Whether `value` could be an id Tollgate issued (anything else names nothing)."""
    return _ID.fullmatch(value) is not None


def require_id(kind: str, value: str) -> None:
    """Raises NotFound for what is not an id (it names nothing), before it reaches SQL."""
    if not is_identifier(value):
        raise NotFound(f"{kind} {shown(value)} does not exist")


def shown(value: str) -> str:
    """`value` quoted for an error message: ASCII only, and cut short when long."""
    if len(value) <= MAX_SHOWN:
        return ascii(value)
    return f"{ascii(value[:MAX_SHOWN])}... ({len(value)} characters)"


def identifier_violation(field: str, value: str) -> FieldViolation | None:
    if is_identifier(value):
        return None
    return FieldViolation(
        field, f"is not an id: 1 to {MAX_ID_LENGTH} of the characters A-Z a-z 0-9 . _ : -"
    )


def text_violation(field: str, value: str, max_length: int) -> FieldViolation | None:
    """Printable text of at most `max_length` characters (no control characters, no
    U+0000, which PostgreSQL cannot store)."""
    if len(value) > max_length:
        return FieldViolation(field, f"longer than {max_length} characters")
    if not value.isprintable():
        return FieldViolation(field, "must hold printable characters only")
    return None


def timestamp_violation(field: str, seconds: int, nanos: int) -> FieldViolation | None:
    if not MIN_TIMESTAMP_SECONDS <= seconds <= MAX_TIMESTAMP_SECONDS:
        return FieldViolation(field, "must be between 0001-01-01 and 9999-12-31")
    if not 0 <= nanos < NANOS_PER_SECOND:
        return FieldViolation(field, "nanos must be in [0, 999999999]")
    return None


def duration_seconds(seconds: int, nanos: int) -> float | None:
    """A google.protobuf.Duration in seconds; None if it is not a valid one (nanos out of
    range or of the other sign than seconds)."""
    if not -NANOS_PER_SECOND < nanos < NANOS_PER_SECOND:
        return None
    if (seconds > 0 and nanos < 0) or (seconds < 0 and nanos > 0):
        return None
    total = seconds + nanos / NANOS_PER_SECOND
    return total if math.isfinite(total) else None


def seq_violation(field: str, value: int) -> FieldViolation | None:
    if 0 <= value <= MAX_SEQ:
        return None
    return FieldViolation(field, f"must be at most {MAX_SEQ}")
