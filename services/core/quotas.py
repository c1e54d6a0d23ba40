"""Tenant and key limits, and the decision whether a run fits them; no I/O.

Rates are counted over an exact sliding window: a run admitted at time `a` counts
against the minute limits at every time `t` with `a <= t < a + 60 s`, with its
reserved tokens until it is billed and its actual tokens after. A run is admitted when
the window ending now, plus the run, stays within each limit; nothing is approximated
at the window's edge, as a fixed window (twice the limit across a minute boundary) or
a two-bucket estimate would. Budgets count a period's spend (day or month, UTC
calendar): the worst case of each run in flight plus the billed amount of each run that
ended, charged to the period the run was admitted in, whether or not the budget existed
then (a budget set partway through a period starts at what the period spent so far:
quota_store.recount_budget).
"""

from __future__ import annotations

import calendar
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from services.core.errors import FieldViolation

WINDOW_SECONDS = 60.0
BUDGET_PERIODS = ("day", "month")
# Waiting cannot be foretold for runs in flight (they end when they end).
IN_FLIGHT_RETRY_SECONDS = 2.0

RATE_LIMITED = "RATE_LIMITED"
BUDGET_EXCEEDED = "BUDGET_EXCEEDED"
CONCURRENCY_LIMITED = "CONCURRENCY_LIMITED"
KV_LIMITED = "KV_LIMITED"
# FAILED_PRECONDITION, not RESOURCE_EXHAUSTED: no wait makes an unpriced model fit a budget.
MODEL_NOT_PRICED = "MODEL_NOT_PRICED"


@dataclass(frozen=True, slots=True)
class QuotaLimits:
    """One subject's limits (a tenant's or a key's); 0 = unlimited."""

    requests_per_minute: int = 0
    input_tokens_per_minute: int = 0
    output_tokens_per_minute: int = 0
    budget_micros: int = 0
    budget_period: str = "month"
    max_concurrent_runs: int = 0
    max_kv_blocks: int = 0

    @property
    def has_rates(self) -> bool:
        return bool(
            self.requests_per_minute
            or self.input_tokens_per_minute
            or self.output_tokens_per_minute
        )


@dataclass(frozen=True, slots=True)
class Demand:
    """What one run reserves: its prompt, its max_tokens, its KV blocks, its worst-case cost
    (None when the model has no price)."""

    input_tokens: int
    output_tokens: int
    num_kv_blocks: int
    spend_micros: int | None


@dataclass(frozen=True, slots=True)
class SubjectUsage:
    """What a subject holds now: runs in flight, the last minute's admissions, the spend of
    its budget period. `now` and the times are seconds since the epoch (the database's)."""

    subject: str  # tenant:<id> | key:<id>
    limits: QuotaLimits
    now: float
    open_runs: int = 0
    open_blocks: int = 0
    requests: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    oldest_at: float | None = None  # the oldest admission in the window
    spent_micros: int = 0
    period_end: float | None = None


@dataclass(frozen=True, slots=True)
class Refusal:
    subject: str
    limit: str  # the QuotaLimits field
    reason: str
    description: str
    # None: the time a window limit frees enough needs the window's admissions.
    retry_after: float | None


@dataclass(frozen=True, slots=True)
class WindowEntry:
    admitted_at: float
    input_tokens: int
    output_tokens: int


def refusal(usage: SubjectUsage, demand: Demand) -> Refusal | None:
    """The first limit the run would break, if any: budget, then runs in flight, then
    KV blocks, then the minute rates."""
    limits = usage.limits
    if limits.budget_micros:
        refused = _budget_refusal(usage, demand)
        if refused is not None:
            return refused
    if limits.max_concurrent_runs and usage.open_runs >= limits.max_concurrent_runs:
        return _in_flight(
            usage,
            "max_concurrent_runs",
            CONCURRENCY_LIMITED,
            f"concurrency quota: {usage.open_runs} of {limits.max_concurrent_runs}"
            " runs in flight (max_concurrent_runs)",
        )
    if limits.max_kv_blocks and usage.open_blocks + demand.num_kv_blocks > limits.max_kv_blocks:
        return _in_flight(
            usage,
            "max_kv_blocks",
            KV_LIMITED,
            f"KV quota: {usage.open_blocks} of {limits.max_kv_blocks} blocks reserved,"
            f" this run needs {demand.num_kv_blocks} (max_kv_blocks)",
        )
    for name, used, cost in _rates(usage, demand):
        limit = getattr(limits, name)
        if limit and used + cost > limit:
            description = (
                f"{name}: {used} of {limit} used in the last minute, this run needs {cost}"
            )
            return Refusal(usage.subject, name, RATE_LIMITED, description, None)
    return None


def _rates(usage: SubjectUsage, demand: Demand) -> list[tuple[str, int, int]]:
    return [
        ("requests_per_minute", usage.requests, 1),
        ("input_tokens_per_minute", usage.input_tokens, demand.input_tokens),
        ("output_tokens_per_minute", usage.output_tokens, demand.output_tokens),
    ]


def cost_of(limit_name: str, demand: Demand) -> int:
    """What the run counts against a minute limit."""
    if limit_name == "input_tokens_per_minute":
        return demand.input_tokens
    if limit_name == "output_tokens_per_minute":
        return demand.output_tokens
    return 1


def _in_flight(usage: SubjectUsage, limit: str, reason: str, description: str) -> Refusal:
    return Refusal(usage.subject, limit, reason, description, IN_FLIGHT_RETRY_SECONDS)


def _budget_refusal(usage: SubjectUsage, demand: Demand) -> Refusal | None:
    limits = usage.limits
    if demand.spend_micros is None:
        return Refusal(
            usage.subject,
            "budget_micros",
            MODEL_NOT_PRICED,
            "budget_micros: the model has no price in TOLLGATE_PRICES, and a budget"
            " admits only priced models",
            None,
        )
    if usage.spent_micros + demand.spend_micros <= limits.budget_micros:
        return None
    end = usage.period_end if usage.period_end is not None else usage.now
    return Refusal(
        usage.subject,
        "budget_micros",
        BUDGET_EXCEEDED,
        f"budget_micros: {usage.spent_micros} of {limits.budget_micros} spent this"
        f" {limits.budget_period}, this run may cost {demand.spend_micros}",
        max(0.0, end - usage.now),
    )


def oversized(limits: QuotaLimits, demand: Demand) -> FieldViolation | None:
    """A run that alone needs more than a minute's tokens: no wait would let it in."""
    if limits.input_tokens_per_minute and demand.input_tokens > limits.input_tokens_per_minute:
        return FieldViolation(
            "prompt",
            f"{demand.input_tokens} prompt tokens exceed the input_tokens_per_minute limit"
            f" of {limits.input_tokens_per_minute}",
        )
    if limits.output_tokens_per_minute and demand.output_tokens > limits.output_tokens_per_minute:
        return FieldViolation(
            "sampling.max_tokens",
            f"max_tokens {demand.output_tokens} exceeds the output_tokens_per_minute limit"
            f" of {limits.output_tokens_per_minute}",
        )
    return None


def remaining(usage: SubjectUsage, limit_name: str, cost: int = 0) -> int:
    """What is left of a limit once `cost` more is counted (never below 0)."""
    return max(0, getattr(usage.limits, limit_name) - used(usage, limit_name) - cost)


def used(usage: SubjectUsage, limit_name: str) -> int:
    """What the subject holds of a limit now."""
    return {
        "requests_per_minute": usage.requests,
        "input_tokens_per_minute": usage.input_tokens,
        "output_tokens_per_minute": usage.output_tokens,
        "budget_micros": usage.spent_micros,
        "max_concurrent_runs": usage.open_runs,
        "max_kv_blocks": usage.open_blocks,
    }[limit_name]


def window_reset(usage: SubjectUsage) -> float:
    """Seconds until the oldest admission in the window leaves it: when what remains
    next grows (a minute from now when the window is empty)."""
    oldest = usage.now if usage.oldest_at is None else usage.oldest_at
    return max(0.0, oldest + WINDOW_SECONDS - usage.now)


def window_wait(
    entries: Sequence[WindowEntry], limit_name: str, limit: int, cost: int, now: float
) -> float:
    """Seconds until the window, losing its oldest admissions as they turn a minute old,
    has room for `cost` more under `limit` (runs admitted meanwhile aside).

    `entries` are the admissions still in the window at `now`, in any order."""
    amounts = sorted((e.admitted_at, _amount(e, limit_name)) for e in entries)
    to_free = sum(amount for _, amount in amounts) + cost - limit
    if to_free <= 0:
        return 0.0
    for admitted_at, amount in amounts:
        to_free -= amount
        if to_free <= 0:
            return max(0.0, admitted_at + WINDOW_SECONDS - now)
    # More than the limit on its own: it never fits (validation refuses such a run).
    return WINDOW_SECONDS


def _amount(entry: WindowEntry, limit_name: str) -> int:
    if limit_name == "input_tokens_per_minute":
        return entry.input_tokens
    if limit_name == "output_tokens_per_minute":
        return entry.output_tokens
    return 1


def in_window(admitted_at: float, now: float) -> bool:
    """Whether an admission at `admitted_at` still counts at `now`."""
    return now - WINDOW_SECONDS < admitted_at <= now


def period_start(now: datetime, period: str) -> datetime:
    """The start of the UTC calendar day or month holding `now`."""
    utc = now.astimezone(UTC)
    day = utc.replace(hour=0, minute=0, second=0, microsecond=0)
    return day if period == "day" else day.replace(day=1)


def period_end(start: datetime, period: str) -> datetime:
    if period == "day":
        return start + timedelta(days=1)
    days = calendar.monthrange(start.year, start.month)[1]
    return start + timedelta(days=days)
