"""The console's page, scripts and styles: package data read through importlib.resources,
so an installed wheel serves them as a source checkout does. There is no build step."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable

CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}
INDEX = "index.html"
# The page loads only its own scripts and styles, and talks only to this server: no
# third-party script may read the secret kept in the tab.
HEADERS = {
    "content-security-policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}


@dataclass(frozen=True, slots=True)
class Asset:
    body: bytes
    content_type: str


def static_dir() -> Traversable:
    return resources.files(__package__).joinpath("static")


def names() -> list[str]:
    """Every file the console serves."""
    return sorted(_assets())


def asset(name: str) -> Asset | None:
    """The file called `name` (a bare name: only the files `names` lists), or None."""
    return _assets().get(name)


@functools.cache
def _assets() -> dict[str, Asset]:
    found = {}
    for entry in static_dir().iterdir():
        suffix = entry.name[entry.name.rfind(".") :]
        if entry.is_file() and suffix in CONTENT_TYPES:
            found[entry.name] = Asset(entry.read_bytes(), CONTENT_TYPES[suffix])
    return found
