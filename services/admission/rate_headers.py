"""The `x-ratelimit-*` answer metadata of an admitted run; no I/O.

Requests are the tighter of the tenant's and the key's `requests_per_minute`; tokens
the tightest of their input and output tokens per minute, the one with the fewest
tokens remaining. `remaining` counts this run; `reset` is the time until the oldest
admission in the window leaves it (when `remaining` next grows), written as OpenAI
writes it (Go durations: `59.5s`, `6m0s`, `120ms`). A limit nobody set sends no header.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.core.quotas import Demand, SubjectUsage, cost_of, remaining, window_reset

REQUESTS = ("requests_per_minute",)
TOKENS = ("input_tokens_per_minute", "output_tokens_per_minute")


def rate_limit_headers(usages: Sequence[SubjectUsage], demand: Demand) -> dict[str, str]:
    """The headers once `demand` is admitted against `usages` (the window before it)."""
    headers: dict[str, str] = {}
    for kind, names in (("requests", REQUESTS), ("tokens", TOKENS)):
        tightest = _tightest(usages, names, demand)
        if tightest is not None:
            limit, left, reset = tightest
            headers[f"x-ratelimit-limit-{kind}"] = str(limit)
            headers[f"x-ratelimit-remaining-{kind}"] = str(left)
            headers[f"x-ratelimit-reset-{kind}"] = go_duration(reset)
    return headers


def _tightest(
    usages: Sequence[SubjectUsage], names: Sequence[str], demand: Demand
) -> tuple[int, int, float] | None:
    found: list[tuple[int, int, float]] = []
    for usage in usages:
        for name in names:
            limit = getattr(usage.limits, name)
            if limit:
                left = remaining(usage, name, cost_of(name, demand))
                found.append((limit, left, window_reset(usage)))
    return min(found, key=lambda f: (f[1], f[1] / f[0])) if found else None


def go_duration(seconds: float) -> str:
    """`1h2m3s`, `6m0s`, `1.5s`, `20ms`: how Go prints a duration, to the millisecond."""
    millis = max(0, round(seconds * 1000))
    if millis < 1000:
        return f"{millis}ms"
    hours, rest = divmod(millis, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"
