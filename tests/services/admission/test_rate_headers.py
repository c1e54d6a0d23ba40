from services.admission.rate_headers import go_duration, rate_limit_headers
from services.core.quotas import Demand, QuotaLimits, SubjectUsage

DEMAND = Demand(input_tokens=10, output_tokens=100, num_kv_blocks=1, spend_micros=0)


def test_durations_read_as_openai_writes_them() -> None:
    assert go_duration(0.017) == "17ms"
    assert go_duration(1) == "1s"
    assert go_duration(59.5) == "59.5s"
    assert go_duration(360) == "6m0s"
    assert go_duration(3723.25) == "1h2m3.25s"


def test_the_tighter_subject_and_token_limit_is_reported() -> None:
    tenant = SubjectUsage(
        "tenant:t",
        QuotaLimits(requests_per_minute=100, output_tokens_per_minute=1000),
        now=100.0,
        requests=10,
        output_tokens=500,
        oldest_at=70.0,
    )
    key = SubjectUsage(
        "key:k", QuotaLimits(requests_per_minute=20, input_tokens_per_minute=5000), now=100.0
    )
    headers = rate_limit_headers([tenant, key], DEMAND)
    assert headers["x-ratelimit-limit-requests"] == "20"
    assert headers["x-ratelimit-remaining-requests"] == "19"
    assert headers["x-ratelimit-reset-requests"] == "1m0s"  # the key's window holds only this run
    assert headers["x-ratelimit-limit-tokens"] == "1000"  # 400 output tokens left, not 4990
    assert headers["x-ratelimit-remaining-tokens"] == "400"
    assert headers["x-ratelimit-reset-tokens"] == "30s"


def test_no_limit_no_header() -> None:
    assert rate_limit_headers([SubjectUsage("tenant:t", QuotaLimits(), now=1.0)], DEMAND) == {}
