"""Where the engine keeps what it builds or downloads once per user."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache(name: str, variable: str) -> Path:
    """`$variable` when set, else `name` under the user's cache (`$XDG_CACHE_HOME/tollgate`)."""
    configured = os.environ.get(variable)
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tollgate" / name
