"""Prices and the ledger entries of one run, free of I/O: what admission reserves a run's
worst case at and the ledger bills it at (both read TOLLGATE_PRICES here).

Money is integer micro-units of the currency, never floats: an amount is
`quantity * unit_price_micros - discount_micros`, exact. A batch run's entries carry the
batch discount (`TOLLGATE_BATCH_DISCOUNT`, a fraction of the list price) in
`discount_micros`, rounded down, so the ledger shows the list price and what was taken
off it; interactive runs pay the list price.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from fractions import Fraction
from typing import Any

from services.core.config import ConfigError

INPUT_TOKENS = "input_tokens"
CACHED_INPUT_TOKENS = "cached_input_tokens"
OUTPUT_TOKENS = "output_tokens"
BILLING_TYPES = (INPUT_TOKENS, CACHED_INPUT_TOKENS, OUTPUT_TOKENS)

ANY_MODEL = "*"
DEFAULT_UNIT_PRICES: Mapping[str, int] = {
    INPUT_TOKENS: 2,
    CACHED_INPUT_TOKENS: 1,
    OUTPUT_TOKENS: 8,
}
DEFAULT_CURRENCY = "USD"
INTERACTIVE, BATCH = "interactive", "batch"


@dataclass(frozen=True, slots=True)
class PriceTable:
    """Unit prices in micro-units per token, per model and billing type.

    A model missing from `models`, or a billing type missing from its prices,
    falls back to the `*` entry and then to DEFAULT_UNIT_PRICES.
    """

    models: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    currency: str = DEFAULT_CURRENCY
    # The fraction of the list price batch runs do not pay, in [0, 1].
    batch_discount: Fraction = Fraction(0)

    def discount_micros(self, priority: str, gross_micros: int) -> int:
        """What a run of `priority` is let off of `gross_micros`, rounded down."""
        if priority != BATCH:
            return 0
        return gross_micros * self.batch_discount.numerator // self.batch_discount.denominator

    def unit_price(self, model: str, billing_type: str) -> int:
        for prices in (self.models.get(model), self.models.get(ANY_MODEL), DEFAULT_UNIT_PRICES):
            if prices is not None and billing_type in prices:
                return prices[billing_type]
        raise KeyError(billing_type)


def parse_prices(
    raw: str | None, currency: str = DEFAULT_CURRENCY, batch_discount: Fraction = Fraction(0)
) -> PriceTable:
    """Parses TOLLGATE_PRICES: {"<model>|*": {"<billing_type>": <int micros per token>}}."""
    if not raw:
        return PriceTable(currency=currency, batch_discount=batch_discount)
    try:
        document = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"TOLLGATE_PRICES is not JSON: {exc}") from None
    if not isinstance(document, dict):
        raise ConfigError("TOLLGATE_PRICES must be a JSON object of models")
    models = {str(m): _model_prices(m, p) for m, p in document.items()}
    return PriceTable(models, currency, batch_discount)


def parse_discount(raw: str | None) -> Fraction:
    """Parses TOLLGATE_BATCH_DISCOUNT: a fraction of the list price in [0, 1], e.g. 0.5."""
    if not raw:
        return Fraction(0)
    try:
        # From the decimal text, not a float: 0.1 is one tenth, not 0.1000000000000000055.
        discount = Fraction(raw.strip())
    except (ValueError, ZeroDivisionError):
        raise ConfigError(f"TOLLGATE_BATCH_DISCOUNT is not a number: {raw!r}") from None
    if not 0 <= discount <= 1:
        raise ConfigError(f"TOLLGATE_BATCH_DISCOUNT must be between 0 and 1, not {raw!r}")
    return discount


def _model_prices(model: str, prices: Any) -> dict[str, int]:
    if not isinstance(prices, dict):
        raise ConfigError(f"TOLLGATE_PRICES[{model!r}] must be an object")
    result: dict[str, int] = {}
    for billing_type, price in prices.items():
        # bool is an int subclass; true/false as a price is a typo, not a price.
        if isinstance(price, bool) or not isinstance(price, int) or price < 0:
            raise ConfigError(
                f"TOLLGATE_PRICES[{model!r}][{billing_type!r}] must be a non-negative integer"
            )
        result[str(billing_type)] = price
    return result


@dataclass(frozen=True, slots=True)
class TokenUsage:
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    output_tokens: int = 0

    @classmethod
    def from_payload(cls, usage: Mapping[str, Any] | None) -> TokenUsage:
        """From a `Usage` JSON object, whose int64 fields may be strings."""
        usage = usage or {}
        return cls(
            prompt_tokens=int(usage.get("prompt_tokens", 0)),
            cached_prompt_tokens=int(usage.get("cached_prompt_tokens", 0)),
            output_tokens=int(usage.get("output_tokens", 0)),
        )

    def quantities(self) -> dict[str, int]:
        cached = max(0, min(self.cached_prompt_tokens, self.prompt_tokens))
        return {
            INPUT_TOKENS: max(0, self.prompt_tokens - cached),
            CACHED_INPUT_TOKENS: cached,
            OUTPUT_TOKENS: max(0, self.output_tokens),
        }


@dataclass(frozen=True, slots=True)
class BillableRun:
    """What pricing needs to know about a terminal run."""

    run_id: str
    tenant_id: str
    idempotency_key: str
    model: str
    usage: TokenUsage
    priority: str = INTERACTIVE


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    entry_id: str
    tenant_id: str
    run_id: str
    idempotency_key: str
    billing_type: str
    model: str
    quantity: int
    unit_price_micros: int
    amount_micros: int
    currency: str
    created_at: datetime | None = None
    discount_micros: int = 0


def entry_id(run_id: str, billing_type: str) -> str:
    return f"{run_id}:{billing_type}"


def price_run(run: BillableRun, prices: PriceTable) -> list[LedgerEntry]:
    """One entry per billing type, zero quantities included, so every run has all three."""
    entries = []
    for billing_type, quantity in run.usage.quantities().items():
        unit_price = prices.unit_price(run.model, billing_type)
        discount = prices.discount_micros(run.priority, quantity * unit_price)
        entries.append(
            LedgerEntry(
                entry_id=entry_id(run.run_id, billing_type),
                tenant_id=run.tenant_id,
                run_id=run.run_id,
                idempotency_key=run.idempotency_key,
                billing_type=billing_type,
                model=run.model,
                quantity=quantity,
                unit_price_micros=unit_price,
                amount_micros=quantity * unit_price - discount,
                currency=prices.currency,
                discount_micros=discount,
            )
        )
    return entries


def total_micros(entries: list[LedgerEntry]) -> int:
    return sum(entry.amount_micros for entry in entries)


def billed_payload(entries: list[LedgerEntry], currency: str) -> dict[str, Any]:
    """The `Billed` message as proto3 JSON with the original field names."""
    return {
        "amount_micros": total_micros(entries),
        "currency": currency,
        "entries": [_entry_json(entry) for entry in entries],
    }


def _entry_json(entry: LedgerEntry) -> dict[str, Any]:
    document: dict[str, Any] = {
        "entry_id": entry.entry_id,
        "tenant_id": entry.tenant_id,
        "run_id": entry.run_id,
        "idempotency_key": entry.idempotency_key,
        "billing_type": entry.billing_type,
        "quantity": entry.quantity,
        "unit_price_micros": entry.unit_price_micros,
        "amount_micros": entry.amount_micros,
    }
    if entry.discount_micros:
        document["discount_micros"] = entry.discount_micros
    if entry.created_at is not None:
        document["create_time"] = entry.created_at.isoformat().replace("+00:00", "Z")
    return document
