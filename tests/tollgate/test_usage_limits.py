from datetime import UTC, datetime

from tollgate.commands.output import usage_report
from tollgate.convert import rate_limits_of
from tollgate.types import LimitUsage, UsageLine, UsageReport


def test_usage_shows_spend_against_budget_and_the_limits_left() -> None:
    midnight = datetime(2025, 1, 2, tzinfo=UTC)
    report = UsageReport(
        "t-1",
        3,
        (UsageLine("output_tokens", 10, 80),),
        80,
        "USD",
        limits=(
            LimitUsage("tenant:t-1", "budget_micros", 1_000_000, 250_000, 750_000, midnight, "day"),
            LimitUsage("key:k-1", "requests_per_minute", 60, 5, 55, midnight),
        ),
    )
    text = usage_report(report)
    budget = next(line for line in text.splitlines() if "budget_micros" in line).split()
    assert budget[:4] == ["tenant:t-1", "budget_micros", "(day)", "0.250000"]
    assert "0.750000" in budget and "2025-01-02T00:00:00+00:00" in budget
    assert "55" in next(line for line in text.splitlines() if "requests_per_minute" in line)


def test_rate_limits_read_from_the_initial_metadata() -> None:
    limits = rate_limits_of(
        [
            ("x-ratelimit-limit-requests", "60"),
            ("x-ratelimit-remaining-requests", "59"),
            ("x-ratelimit-reset-requests", "1s"),
            ("x-ratelimit-reset-tokens", "6m0s"),
        ]
    )
    assert (limits.limit_requests, limits.remaining_requests) == (60, 59)
    assert (limits.reset_requests, limits.reset_tokens, limits.limit_tokens) == ("1s", "6m0s", None)
