"""Per-request sampling and stopping parameters."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from engine.errors import RequestError

# Below it the draw is all but greedy, and a far smaller (subnormal) temperature would
# overflow the float32 logits it divides into NaN probabilities.
GREEDY_TEMPERATURE = 1e-5
# OpenAI's bounds on the penalties and on logit_bias.
MAX_PENALTY = 2.0
MAX_BIAS = 100.0
MAX_LOGIT_BIAS = 300
MAX_REPETITION_PENALTY = 10.0


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

    Penalties and biases change the logits before temperature and the filters, greedy
    runs included, as OpenAI and vLLM apply them: `frequency_penalty` is subtracted once
    per earlier occurrence of a token in the output, `presence_penalty` once if it
    occurred at all (both in [-2, 2]); `repetition_penalty` (> 0, 1 = off) divides the
    positive logits and multiplies the negative ones of every token in the prompt or the
    output; `logit_bias` adds (token id, bias) pairs, bias in [-100, 100]. `min_p` (in
    [0, 1]) drops tokens less likely than `min_p` times the likeliest one.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise RequestError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise RequestError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise RequestError("top_p must be in (0, 1]")
        if any(not s for s in self.stop):
            raise RequestError("stop strings must be non-empty")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise RequestError(f"{name} must be between -{MAX_PENALTY:g} and {MAX_PENALTY:g}")
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise RequestError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}]")
        if not 0 <= self.min_p <= 1:
            raise RequestError("min_p must be between 0 and 1")
        bias = dict(self.logit_bias)  # a token named twice: the last bias
        if len(bias) > MAX_LOGIT_BIAS:
            raise RequestError(f"logit_bias may name at most {MAX_LOGIT_BIAS} tokens")
        if any(not -MAX_BIAS <= b <= MAX_BIAS for b in bias.values()):
            raise RequestError(f"logit_bias values must be between -{MAX_BIAS:g} and {MAX_BIAS:g}")
        # Accept lists from callers while keeping the dataclass hashable and immutable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", tuple(sorted(bias.items())))

    @property
    def penalized(self) -> bool:
        """Whether the logits change before sampling (a penalty or a bias)."""
        return bool(
            self.frequency_penalty
            or self.presence_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1
