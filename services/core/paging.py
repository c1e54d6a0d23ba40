"""Opaque page tokens for keyset pagination over (created_at, entry_id)."""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from datetime import datetime

from services.core.validation import is_identifier

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 500
# A token this service issued is far shorter: base64 of a timestamp, an entry id and a scope.
MAX_PAGE_TOKEN = 1024


class BadPageRequest(ValueError):
    """The field named by `field` is malformed."""

    def __init__(self, field: str, description: str) -> None:
        super().__init__(f"{field}: {description}")
        self.field = field
        self.description = description


@dataclass(frozen=True, slots=True)
class PageKey:
    """The last entry of a page, and the filter the page was listed with."""

    created_at: datetime
    entry_id: str
    scope: str


def page_size(requested: int) -> int:
    if requested < 0:
        raise BadPageRequest("page_size", "must not be negative")
    return min(requested or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)


def encode(key: PageKey) -> str:
    document = {"c": key.created_at.isoformat(), "e": key.entry_id, "s": key.scope}
    raw = json.dumps(document, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode(token: str, scope: str) -> PageKey | None:
    """None for an empty token (the first page); raises BadPageRequest otherwise."""
    if not token:
        return None
    if len(token) > MAX_PAGE_TOKEN:
        raise BadPageRequest("page_token", "is not a token this service issued")
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        document = json.loads(raw)
        key = PageKey(datetime.fromisoformat(document["c"]), str(document["e"]), document["s"])
    except (binascii.Error, ValueError, KeyError, TypeError, RecursionError):
        raise BadPageRequest("page_token", "is not a token this service issued") from None
    if key.created_at.tzinfo is None or not is_identifier(key.entry_id):
        raise BadPageRequest("page_token", "is not a token this service issued")
    if key.scope != scope:
        # A token names a position in one listing; reusing it with other filters would skip rows.
        raise BadPageRequest("page_token", "was issued for a request with other filters")
    return key
