from datetime import UTC, datetime

from services.core.quotas import (
    BUDGET_EXCEEDED,
    CONCURRENCY_LIMITED,
    MODEL_NOT_PRICED,
    RATE_LIMITED,
    WINDOW_SECONDS,
    Demand,
    QuotaLimits,
    SubjectUsage,
    WindowEntry,
    in_window,
    oversized,
    period_end,
    period_start,
    refusal,
    window_wait,
)

DEMAND = Demand(input_tokens=10, output_tokens=20, num_kv_blocks=2, spend_micros=100)


def usage(limits: QuotaLimits, **held: object) -> SubjectUsage:
    return SubjectUsage("tenant:t", limits, now=1000.0, **held)  # type: ignore[arg-type]


def test_an_admission_counts_for_exactly_one_minute() -> None:
    assert in_window(940.0 + 1e-6, 1000.0)
    assert not in_window(940.0, 1000.0)  # a minute old: out, not one moment later
    assert in_window(1000.0, 1000.0)


def test_the_wait_is_until_enough_of_the_oldest_admissions_are_a_minute_old() -> None:
    entries = [WindowEntry(950.0, 0, 0), WindowEntry(945.0, 0, 0), WindowEntry(990.0, 0, 0)]
    # Three of three used: one must leave, the oldest (945) at 1005.
    assert window_wait(entries, "requests_per_minute", 3, 1, 1000.0) == 5.0
    # Two must leave for a cost of two: the second oldest (950) at 1010.
    assert window_wait(entries, "requests_per_minute", 3, 2, 1000.0) == 10.0
    assert window_wait(entries, "requests_per_minute", 4, 1, 1000.0) == 0.0


def test_token_waits_count_tokens_not_admissions() -> None:
    entries = [WindowEntry(941.0, 70, 0), WindowEntry(990.0, 20, 0)]
    # 90 of 100 used, 30 wanted: 20 must go, the first admission's 70 leave at 1001.
    assert window_wait(entries, "input_tokens_per_minute", 100, 30, 1000.0) == 1.0
    assert window_wait(entries, "input_tokens_per_minute", 100, 10, 1000.0) == 0.0


def test_at_the_boundary_the_window_frees_exactly_then() -> None:
    limits = QuotaLimits(requests_per_minute=1)
    just_before = SubjectUsage("tenant:t", limits, now=1000.0, requests=1, oldest_at=940.5)
    refused = refusal(just_before, DEMAND)
    assert refused is not None and refused.reason == RATE_LIMITED
    assert window_wait([WindowEntry(940.5, 0, 0)], refused.limit, 1, 1, 1000.0) == 0.5
    # At 1000.5 the admission of 940.5 no longer counts, so the window reads empty.
    assert not in_window(940.5, 1000.5)
    assert refusal(SubjectUsage("tenant:t", limits, now=1000.5), DEMAND) is None


def test_each_rate_limit_names_itself() -> None:
    for name, held in (
        ("requests_per_minute", {"requests": 5}),
        ("input_tokens_per_minute", {"input_tokens": 95}),
        ("output_tokens_per_minute", {"output_tokens": 90}),
    ):
        limits = QuotaLimits(**{name: 100 if name != "requests_per_minute" else 5})
        refused = refusal(usage(limits, **held), DEMAND)
        assert refused is not None and refused.limit == name
        assert refused.description.startswith(name) and refused.retry_after is None


def test_a_budget_waits_for_its_period_to_end() -> None:
    limits = QuotaLimits(budget_micros=1000, budget_period="day")
    refused = refusal(usage(limits, spent_micros=950, period_end=4600.0), DEMAND)
    assert refused is not None and refused.reason == BUDGET_EXCEEDED
    assert refused.retry_after == 3600.0
    assert refusal(usage(limits, spent_micros=900, period_end=4600.0), DEMAND) is None


def test_a_budget_refuses_a_model_without_a_price() -> None:
    unpriced = Demand(10, 20, 2, spend_micros=None)
    refused = refusal(usage(QuotaLimits(budget_micros=10**9)), unpriced)
    assert refused is not None and refused.reason == MODEL_NOT_PRICED
    assert refusal(usage(QuotaLimits()), unpriced) is None


def test_runs_in_flight_are_checked_before_rates() -> None:
    limits = QuotaLimits(max_concurrent_runs=2, requests_per_minute=1)
    refused = refusal(usage(limits, open_runs=2, requests=1), DEMAND)
    assert refused is not None and refused.reason == CONCURRENCY_LIMITED


def test_a_run_larger_than_a_minute_of_tokens_is_a_bad_request() -> None:
    violation = oversized(QuotaLimits(output_tokens_per_minute=19), DEMAND)
    assert violation is not None and violation.field == "sampling.max_tokens"
    assert oversized(QuotaLimits(output_tokens_per_minute=20), DEMAND) is None


def test_budget_periods_are_utc_calendar_days_and_months() -> None:
    now = datetime(2024, 2, 29, 23, 59, 59, tzinfo=UTC)
    day = period_start(now, "day")
    assert day == datetime(2024, 2, 29, tzinfo=UTC)
    assert period_end(day, "day") == datetime(2024, 3, 1, tzinfo=UTC)
    month = period_start(now, "month")
    assert month == datetime(2024, 2, 1, tzinfo=UTC)
    assert period_end(month, "month") == datetime(2024, 3, 1, tzinfo=UTC)
    assert WINDOW_SECONDS == 60.0
