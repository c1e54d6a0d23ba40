"""Per-request sampling and stopping parameters."""

from __future__ import annotations

from collections.abc import Sequence
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
# OpenAI's bound on top_logprobs.
MAX_LOGPROBS = 20
# The most answers one request may ask for.
MAX_N = 16


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

    `json_schema` (a JSON schema as JSON text; `{"type": "object"}` for any JSON object)
    or `grammar` (a Lark grammar in llguidance's dialect, which may embed `%json {...}`),
    not both, constrain the output: each step the tokens the grammar does not allow next
    are masked out, and the request ends with reason "stop" once the grammar allows
    nothing more (or the model's EOS where it may end).

    `n` answers are drawn independently from the one prompt (each with its own generator:
    `seed + i` for answer i when seeded); the prompt is computed once and its full KV
    blocks shared (`blocks_for_run`).

    `logprobs` (None: none; k in [0, MAX_LOGPROBS]) returns each output token's
    log-probability and the k likeliest tokens' with theirs. They are the log-softmax of
    the logits after penalties, biases and the grammar's mask, before temperature and the
    top-k / top-p / min-p filters: neither vLLM's default "raw" logprobs (the model's own
    distribution, before penalties and biases) nor its "processed" ones (after
    temperature and the filters too). Tokens the grammar forbids are never among the k.

    `prompt_logprobs` (None: none; k in [0, MAX_LOGPROBS]) returns, with the first output
    token, the log-probability of each prompt token but the first given the ones before
    it, and the k likeliest tokens in its place: the model's own distribution (no
    penalty, bias, grammar or temperature applies to a prompt). The request computes its
    whole prompt for them, finding none of it in the prefix cache.
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
    json_schema: str = ""
    grammar: str = ""
    logprobs: int | None = None
    n: int = 1
    prompt_logprobs: int | None = None

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
        if not 1 <= self.n <= MAX_N:
            raise RequestError(f"n must be between 1 and {MAX_N}")
        if self.json_schema and self.grammar:
            raise RequestError("json_schema and grammar are exclusive: give at most one")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise RequestError(f"{name} must be between 0 and {MAX_LOGPROBS}")
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
    def constrained(self) -> bool:
        """Whether a JSON schema or a grammar constrains the output."""
        return bool(self.json_schema or self.grammar)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


def blocks_for_run(num_prompt_tokens: int, max_tokens: int, n: int, block_size: int) -> int:
    """The KV blocks a request holds at most: its prompt's full blocks once, shared by its
    `n` answers, and each answer's own tail (the prompt's last partial block and its
    output)."""
    shared = num_prompt_tokens // block_size if n > 1 else 0
    own = num_prompt_tokens - shared * block_size + max_tokens
    return shared + n * -(-own // block_size)


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What a request is checked against before it is queued."""

    vocab_size: int
    max_model_len: int
    num_total_blocks: int
    block_size: int

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def check(self, token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raises RequestError naming what is wrong with the request."""
        if not token_ids:
            raise RequestError("the prompt is empty")
        if min(token_ids) < 0 or max(token_ids) >= self.vocab_size:
            raise RequestError(f"prompt token ids must be in [0, {self.vocab_size})")
        if len(token_ids) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(token_ids)} tokens; this model takes at most {self.max_model_len - 1}"
            )
        max_tokens = min(params.max_tokens, self.max_model_len - len(token_ids))
        needed = blocks_for_run(len(token_ids), max_tokens, params.n, self.block_size)
        if needed > self.num_total_blocks:
            raise RequestError(
                f"the request needs {needed} KV blocks; the pool has {self.num_total_blocks}"
            )
