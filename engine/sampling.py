"""Per-request sampling and stopping parameters."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from engine.errors import RequestError

# Below it the draw is all but greedy, and a far smaller (subnormal) temperature would
# overflow the float32 logits it divides into NaN probabilities.
GREEDY_TEMPERATURE = 1e-5


class Priority(IntEnum):
    """Scheduling class of a request; lower values are served first."""

    INTERACTIVE = 0
    BATCH = 1

    @classmethod
    def parse(cls, value: Priority | str) -> Priority:
        if isinstance(value, Priority):
            return value
        try:
            return cls[value.upper()]
        except KeyError:
            raise RequestError(
                f"unknown priority {value!r} (expected 'interactive' or 'batch')"
            ) from None


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    A `temperature` below GREEDY_TEMPERATURE is greedy. `top_k <= 0` and `top_p >= 1`
    disable those filters.
    `seed` makes the draw reproducible whatever else shares the batch.
    `stop` strings end the output (the matched text is not returned); `stop_token_ids`
    and the model's EOS tokens end it with reason "stop" unless `ignore_eos`.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise RequestError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise RequestError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise RequestError("top_p must be in (0, 1]")
        if any(not s for s in self.stop):
            raise RequestError("stop strings must be non-empty")
        # Accept lists from callers while keeping the dataclass hashable and immutable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1
