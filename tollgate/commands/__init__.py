"""The client side of the `tollgate` command line: generate, chat, runs, events, usage, admin,
health."""

from __future__ import annotations

from typing import Any

from tollgate.commands import admin, chat, events, generate, health, runs, usage


def register(subparsers: Any) -> None:
    """Adds every client command to the `tollgate` command line."""
    for module in (generate, chat, runs, events, usage, admin, health):
        module.register(subparsers)
