"""The values the SDK hands back: frozen dataclasses, never generated protobuf types.

Run states and event kinds are lower-case words: "queued", "prefill", "streaming",
"completed", "failed", "cancelled", "billed". Money is in integer micro-units.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

TERMINAL_STATES = frozenset({"completed", "failed", "cancelled"})
FINAL_STATE = "billed"


@dataclass(frozen=True, slots=True)
class Usage:
    """What a run consumed."""

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    output_tokens: int = 0
    kv_blocks_peak: int = 0
    kv_block_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class Model:
    """A model the gateway serves the caller: a base model, or a LoRA adapter on `base`."""

    name: str
    base: str = ""  # the adapter's base model; "" for a base model
    context_length: int = 0  # prompt and output tokens one run may hold; 0: unknown


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    """One billed line of one run."""

    entry_id: str
    tenant_id: str
    run_id: str
    idempotency_key: str
    billing_type: str  # "input_tokens" | "cached_input_tokens" | "output_tokens" | ...
    quantity: int
    unit_price_micros: int
    amount_micros: int
    create_time: datetime | None = None
    # What a batch run was let off the list price: amount = quantity × unit price − this.
    discount_micros: int = 0


@dataclass(frozen=True, slots=True)
class TopLogprob:
    """One of the likeliest tokens at a position."""

    token_id: int
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A streamed token's log-probability, and the likeliest tokens in its place,
    likeliest first (as many as the run's `top_logprobs`)."""

    token_id: int
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A function call the model made, or an earlier one a chat message carries."""

    id: str
    name: str
    arguments: str  # a JSON object as text


@dataclass(frozen=True, slots=True)
class RunEvent:
    """One event of a run's log.

    `kind` names what happened and equals `state`, the run's state after it.
    Only the fields of the event's kind are set; the others keep their defaults:

    * queued: model, priority, prompt_token_ids, requeue_reason
    * prefill: worker_id, cached_prompt_tokens
    * streaming: text (the UTF-8-safe delta), token_ids, logprobs (one per token when
      the run asked for them); with n > 1, index (the answer) and, on an answer's last
      tokens, finish_reason; on the first, prompt_logprobs (one per prompt token after
      the first, when the run asked for them); at, where its tokens start among the
      run's output over all answers (tokens, characters of text; None from a server
      that does not say)
    * completed: finish_reason ("stop" | "length" | "stop_sequence"), usage, ttft_seconds
    * failed: error_code (e.g. "WORKER_LOST"), error_message, usage
    * cancelled: cancel_reason, usage
    * billed: amount_micros, currency, entries

    A `live` event is a streaming one whose tokens are not stored yet: its `seq` is the
    last stored event's, so several events share a seq. The stored event that later
    holds those tokens comes cut to what the stream has not sent (possibly nothing):
    each token's text arrives exactly once.
    """

    run_id: str
    seq: int
    state: str
    kind: str
    tenant_id: str = ""
    time: datetime | None = None
    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    index: int = 0
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    usage: Usage | None = None
    finish_reason: str = ""
    ttft_seconds: float | None = None
    error_code: str = ""
    error_message: str = ""
    cancel_reason: str = ""
    model: str = ""
    priority: str = ""
    prompt_token_ids: tuple[int, ...] = ()
    requeue_reason: str = ""
    worker_id: str = ""
    cached_prompt_tokens: int = 0
    amount_micros: int = 0
    currency: str = ""
    entries: tuple[LedgerEntry, ...] = ()
    live: bool = False
    at: tuple[int, int] | None = None

    @property
    def is_terminal(self) -> bool:
        """True for completed, failed and cancelled: the run produces nothing more."""
        return self.kind in TERMINAL_STATES

    @property
    def position(self) -> str:
        """Where a client that has this event stands, for `stream_run(starting_after=...)`:
        its seq, or for a live event `seq.tokens.chars` (the run's output up to its end),
        as for a stored one cut to nothing (the client had all of it live, and maybe more),
        as the HTTP API's event ids."""
        cut_to_nothing = self.kind == "streaming" and not self.token_ids and not self.text
        if not (self.live or cut_to_nothing) or self.at is None:
            return str(self.seq)
        return f"{self.seq}.{self.at[0] + len(self.token_ids)}.{self.at[1] + len(self.text)}"

    @property
    def is_final(self) -> bool:
        """True for billed, always a run's last event."""
        return self.kind == FINAL_STATE


@dataclass(frozen=True, slots=True)
class Run:
    """A run's current state, as GetRun / ListRuns / CancelRun report it."""

    run_id: str
    tenant_id: str
    model: str
    state: str
    last_seq: int
    usage: Usage | None
    idempotency_key: str
    finish_reason: str
    priority: str
    create_time: datetime | None
    update_time: datetime | None


@dataclass(frozen=True, slots=True)
class RunPage:
    runs: tuple[Run, ...]
    next_page_token: str


@dataclass(frozen=True, slots=True)
class LedgerEntryPage:
    entries: tuple[LedgerEntry, ...]
    next_page_token: str


@dataclass(frozen=True, slots=True)
class UsageLine:
    billing_type: str
    quantity: int
    amount_micros: int


@dataclass(frozen=True, slots=True)
class UsageReport:
    """A tenant's billed usage over a period."""

    tenant_id: str
    num_runs: int
    lines: tuple[UsageLine, ...]
    amount_micros: int
    currency: str
    limits: tuple[LimitUsage, ...] = ()


@dataclass(frozen=True, slots=True)
class LimitUsage:
    """One limit and where it stands: the budget's spend counts runs in flight at their
    worst case; `reset_time` is when `remaining` next grows (None for runs in flight)."""

    subject: str  # "tenant:<id>" | "key:<id>"
    name: str  # the Quota field
    limit: int
    used: int
    remaining: int
    reset_time: datetime | None = None
    budget_period: str = ""


@dataclass(frozen=True, slots=True)
class Reconciliation:
    """Runs whose billing or KV reservation does not add up, or that have not ended in
    time (stuck); `ok` when there are none."""

    ok: bool
    unbilled_run_ids: tuple[str, ...]
    unreleased_run_ids: tuple[str, ...]
    mismatched_run_ids: tuple[str, ...]
    stuck_run_ids: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class RateLimits:
    """The `x-ratelimit-*` metadata an admitted run came with: the tighter of the tenant's
    and the key's minute limits, what remains of them with this run counted, and when what
    remains next grows (`reset_*`, a Go duration such as `"6m0s"`). None where no limit
    applies."""

    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests: str = ""
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens: str = ""


@dataclass(frozen=True, slots=True)
class Quota:
    """A tenant's limits; 0 means unlimited, `max_concurrent_streams` None the admission's
    default (streams open at once per admission replica)."""

    tenant_id: str
    max_kv_blocks: int = 0
    max_concurrent_runs: int = 0
    max_concurrent_streams: int | None = None
    requests_per_minute: int = 0
    input_tokens_per_minute: int = 0
    output_tokens_per_minute: int = 0
    budget_micros: int = 0
    budget_period: str = "month"  # "day" | "month", UTC calendar
    key_id: str = ""  # set: one API key's own limits


@dataclass(frozen=True, slots=True)
class Tenant:
    tenant_id: str
    name: str
    weight: int
    quota: Quota | None = None
    key_quotas: tuple[Quota, ...] = ()  # its keys' own limits


@dataclass(frozen=True, slots=True)
class ApiKey:
    """An API key; `secret` is set only in the answers to create_api_key and rotate_api_key.

    `allowed_models` empty: every model; `expire_time` None: never expires;
    `previous_secret_expire_time`: until when the secret the last rotation replaced works."""

    key_id: str
    tenant_id: str
    revoked: bool
    # Kept out of repr so that logging the value never leaks the key.
    secret: str = field(default="", repr=False)
    allowed_models: tuple[str, ...] = ()
    expire_time: datetime | None = None
    alias: str = ""
    last_used_time: datetime | None = None
    create_time: datetime | None = None
    previous_secret_expire_time: datetime | None = None


@dataclass(frozen=True, slots=True)
class ApiKeyPage:
    api_keys: tuple[ApiKey, ...]
    next_page_token: str


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """A chat turn: an assistant's may carry its function calls, a "tool" turn answers
    the call `tool_call_id` names."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How a broken stream is resumed: attempts in a row without a new event, and backoff."""

    max_attempts: int = 6
    initial_backoff: float = 0.1
    max_backoff: float = 5.0
    multiplier: float = 2.0
    # A server's RetryInfo longer than this is not waited for: the error is raised.
    max_retry_after: float = 30.0
