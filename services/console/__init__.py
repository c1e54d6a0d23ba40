"""The web console at `<http>/console`: a tenant's runs, timelines, playground and usage,
and the operator's fleet, latency, spend, relay and reconciliation views."""

from services.console.routes import ConsoleSettings, console_router

__all__ = ["ConsoleSettings", "console_router"]
