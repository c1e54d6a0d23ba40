"""The most a run can cost, reserved against budgets at admission; no I/O.

The ledger bills the run's actual usage at the same prices (services/core/pricing.py)
and settles the reservation to it. A model TOLLGATE_PRICES names neither by itself nor
by `*` has no price of its own (the ledger bills it at the built-in defaults): a subject
with a budget is refused it rather than let it through at a price nobody set.
"""

from __future__ import annotations

from services.core.pricing import (
    ANY_MODEL,
    CACHED_INPUT_TOKENS,
    INPUT_TOKENS,
    OUTPUT_TOKENS,
    PriceTable,
)


def is_priced(prices: PriceTable, model: str) -> bool:
    # No TOLLGATE_PRICES at all: the built-in prices are the prices.
    return not prices.models or model in prices.models or ANY_MODEL in prices.models


def worst_case_micros(
    prices: PriceTable, model: str, num_prompt_tokens: int, max_tokens: int
) -> int | None:
    """Every prompt token at the dearer of the input prices, and max_tokens output
    tokens; None when the model has no price."""
    if not is_priced(prices, model):
        return None
    per_prompt_token = max(
        prices.unit_price(model, INPUT_TOKENS), prices.unit_price(model, CACHED_INPUT_TOKENS)
    )
    return num_prompt_tokens * per_prompt_token + max_tokens * prices.unit_price(
        model, OUTPUT_TOKENS
    )
