from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.core.config import ConfigError
from services.core.pricing import (
    BILLING_TYPES,
    BillableRun,
    PriceTable,
    TokenUsage,
    billed_payload,
    parse_discount,
    parse_prices,
    price_run,
)


def run(usage: TokenUsage, model: str = "tiny") -> BillableRun:
    return BillableRun("r1", "t1", "run:r1", model, usage)


def test_defaults_when_unset() -> None:
    table = parse_prices(None)
    assert table.currency == "USD"
    assert [table.unit_price("any", t) for t in BILLING_TYPES] == [2, 1, 8]


def test_model_prices_override_the_wildcard_per_billing_type() -> None:
    table = parse_prices(
        '{"*": {"input_tokens": 3, "cached_input_tokens": 1, "output_tokens": 9},'
        ' "big": {"output_tokens": 100}}',
        "EUR",
    )
    assert table.currency == "EUR"
    assert table.unit_price("big", "output_tokens") == 100
    assert table.unit_price("big", "input_tokens") == 3
    assert table.unit_price("small", "output_tokens") == 9


@pytest.mark.parametrize(
    "raw",
    [
        "not json",
        "[1]",
        '{"*": 3}',
        '{"*": {"input_tokens": 1.5}}',
        '{"*": {"input_tokens": -1}}',
        '{"*": {"input_tokens": true}}',
    ],
)
def test_malformed_prices_name_the_variable(raw: str) -> None:
    with pytest.raises(ConfigError, match="TOLLGATE_PRICES"):
        parse_prices(raw)


def test_entries_split_cached_input_from_input() -> None:
    entries = price_run(run(TokenUsage(10, 4, 5)), PriceTable())
    assert [
        (e.billing_type, e.quantity, e.unit_price_micros, e.amount_micros) for e in entries
    ] == [
        ("input_tokens", 6, 2, 12),
        ("cached_input_tokens", 4, 1, 4),
        ("output_tokens", 5, 8, 40),
    ]
    assert {e.entry_id for e in entries} == {f"r1:{t}" for t in BILLING_TYPES}
    assert all(e.idempotency_key == "run:r1" and e.currency == "USD" for e in entries)


def test_a_run_without_usage_still_gets_all_three_entries_at_zero() -> None:
    entries = price_run(run(TokenUsage.from_payload({})), PriceTable())
    assert [(e.billing_type, e.amount_micros) for e in entries] == [(t, 0) for t in BILLING_TYPES]


def test_usage_from_proto_json_accepts_int64_strings() -> None:
    usage = TokenUsage.from_payload(
        {"prompt_tokens": "7", "cached_prompt_tokens": "2", "output_tokens": 3}
    )
    assert usage == TokenUsage(7, 2, 3)


def test_billed_payload_totals_the_entries() -> None:
    entries = price_run(run(TokenUsage(10, 4, 5)), PriceTable())
    payload = billed_payload(entries, "USD")
    assert payload["amount_micros"] == 56
    assert payload["currency"] == "USD"
    assert [e["billing_type"] for e in payload["entries"]] == list(BILLING_TYPES)


@given(
    prompt=st.integers(0, 10**9),
    cached=st.integers(0, 10**9),
    output=st.integers(0, 10**9),
    unit=st.integers(0, 10**6),
)
def test_amounts_are_exact_integers(prompt: int, cached: int, output: int, unit: int) -> None:
    table = PriceTable({"*": {t: unit for t in BILLING_TYPES}})
    entries = price_run(run(TokenUsage(prompt, cached, output)), table)
    assert all(e.quantity >= 0 for e in entries)
    assert sum(e.amount_micros for e in entries) == (prompt + output) * unit


def test_an_adapter_is_billed_under_its_own_name_and_price() -> None:
    """A run for an adapter carries the adapter's model name, which the worker served."""
    table = parse_prices('{"tiny": {"output_tokens": 8}, "tiny-sql": {"output_tokens": 12}}')
    usage = TokenUsage(prompt_tokens=4, output_tokens=10)
    tuned = {e.billing_type: e for e in price_run(run(usage, model="tiny-sql"), table)}
    base = {e.billing_type: e for e in price_run(run(usage), table)}
    assert tuned["output_tokens"].model == "tiny-sql"
    assert (tuned["output_tokens"].amount_micros, base["output_tokens"].amount_micros) == (120, 80)
    assert tuned["input_tokens"].unit_price_micros == 2  # unpriced types fall back as usual


def test_batch_runs_pay_the_list_price_less_the_discount_rounded_down() -> None:
    table = parse_prices(None, batch_discount=parse_discount("0.3"))
    usage = TokenUsage(prompt_tokens=10, cached_prompt_tokens=4, output_tokens=5)
    batch = price_run(BillableRun("r1", "t1", "run:r1", "tiny", usage, "batch"), table)
    assert [(e.unit_price_micros, e.discount_micros, e.amount_micros) for e in batch] == [
        (2, 3, 9),  # 6 input tokens: 12 at list price, 3.6 off
        (1, 1, 3),
        (8, 12, 28),
    ]
    interactive = price_run(run(usage), table)
    assert [e.discount_micros for e in interactive] == [0, 0, 0]
    assert billed_payload(batch, "USD")["entries"][2]["discount_micros"] == 12
    assert "discount_micros" not in billed_payload(interactive, "USD")["entries"][0]


def test_no_batch_discount_by_default() -> None:
    assert parse_discount(None) == parse_discount("") == 0
    assert parse_discount("0.5") == Fraction(1, 2)


@pytest.mark.parametrize("raw", ["half", "-0.1", "1.5", "nan"])
def test_a_batch_discount_outside_0_to_1_is_a_config_error(raw: str) -> None:
    with pytest.raises(ConfigError, match="TOLLGATE_BATCH_DISCOUNT"):
        parse_discount(raw)
