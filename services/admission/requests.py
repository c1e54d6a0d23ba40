"""A generation request as the core sees it, and the checks of its fields (no I/O)."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

from engine.sampling import MAX_BIAS, MAX_LOGIT_BIAS, MAX_N, MAX_PENALTY, MAX_REPETITION_PENALTY
from engine.structure import FREE_TEXT, Structure, ToolCall
from services.core.errors import FieldViolation
from services.core.sampling import structure_payload
from services.core.validation import shown, text_violation

ROLES = frozenset({"system", "user", "assistant", "tool"})
PRIORITIES = {1: "interactive", 2: "batch"}
MAX_IDEMPOTENCY_KEY = 256
MAX_STOP_STRINGS = 8
MAX_STOP_LENGTH = 128
MAX_STOP_TOKEN_IDS = 64
# A longer grace would keep an abandoned run, and the task waiting on it, alive for ever.
MAX_DISCONNECT_GRACE = 3600.0
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class Limits:
    max_tokens: int = 4096
    max_message_chars: int = 65_536
    max_messages: int = 256
    # Across the prompt and every message: all of it is templated and tokenized before
    # the context length can be checked.
    max_total_chars: int = 262_144
    # The `queued` event as published: well under the broker's 1 MiB message limit. An
    # event over it would stall the relay, and every event behind it, for everybody.
    max_event_bytes: int = 512 * 1024
    default_disconnect_grace: float = 30.0


# Sampling's fields that `payload` writes in a form of their own (or not at all: a
# default that must leave the payload, and so the request's hash, as it was).
_WRITTEN_APART = ("logit_bias", "structure", "logprobs", "top_logprobs", "n", "prompt_logprobs")


@dataclass(frozen=True, slots=True)
class Sampling:
    max_tokens: int
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    # (token id, bias) pairs in token order.
    logit_bias: tuple[tuple[int, float], ...] = ()
    structure: Structure = FREE_TEXT
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    prompt_logprobs: bool = False

    def payload(self) -> dict[str, Any]:
        """The SamplingParams JSON form, unset fields left out (`logit_bias` as protobuf's
        JSON writes a map: token ids as strings)."""
        payload = {
            k: list(v) if isinstance(v, tuple) else v
            for k, v in asdict(self).items()
            if v not in (None, ()) and k not in _WRITTEN_APART
        }
        if self.n != 1:
            payload["n"] = self.n
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name):
                payload |= {name: True, "top_logprobs": self.top_logprobs}
        if self.logit_bias:
            payload["logit_bias"] = {str(token): bias for token, bias in self.logit_bias}
        return payload | structure_payload(self.structure)


class ChatTurn(NamedTuple):
    """One message of a conversation: an assistant's may carry its earlier function
    calls, a tool's names the call it answers."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""

    def canonical(self) -> list[Any]:
        """Its form in a request's hash: a plain turn is [role, content]."""
        if not self.tool_calls and not self.tool_call_id:
            return [self.role, self.content]
        calls = [[c.id, c.name, c.arguments] for c in self.tool_calls]
        return [self.role, self.content, calls, self.tool_call_id]


@dataclass(frozen=True, slots=True)
class GenerateParams:
    model: str
    prompt: str
    messages: tuple[ChatTurn, ...]
    sampling: Sampling
    priority: str
    idempotency_key: str
    disconnect_grace: float
    until_terminal: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict)
    # No client's disconnect cancels it (a background response): it runs to its end.
    detached: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "messages", tuple(ChatTurn(*m) for m in self.messages))

    def request_hash(self) -> str:
        """Names what was asked, so a reused idempotency key can be told apart."""
        canonical = {
            "model": self.model,
            "prompt": self.prompt,
            "messages": [m.canonical() for m in self.messages],
            "sampling": self.sampling.payload(),
            "priority": self.priority,
        }
        return hashlib.sha256(json.dumps(canonical, sort_keys=True).encode()).hexdigest()


def field_violations(
    params: GenerateParams, models: Collection[str], limits: Limits
) -> list[FieldViolation]:
    """Every bad field of the request, each named as the gRPC request names it."""
    return [
        *_request_violations(params, models, limits),
        *_sampling_violations(params.sampling, limits),
    ]


def _request_violations(
    params: GenerateParams, models: Collection[str], limits: Limits
) -> list[FieldViolation]:
    found: list[FieldViolation] = []
    if params.model not in models:
        found.append(
            FieldViolation(
                "model", f"unknown model {shown(params.model)}; known: {', '.join(sorted(models))}"
            )
        )
    if params.priority not in PRIORITIES.values():
        found.append(FieldViolation("priority", "must be PRIORITY_INTERACTIVE or PRIORITY_BATCH"))
    if not params.prompt and not params.messages:
        found.append(FieldViolation("prompt", "set a prompt or messages"))
    if params.prompt and params.messages:
        found.append(FieldViolation("messages", "set either prompt or messages, not both"))
    found += _text_violations(params, limits)
    key = text_violation("idempotency_key", params.idempotency_key, MAX_IDEMPOTENCY_KEY)
    if key is not None:
        found.append(key)
    if not 0 <= params.disconnect_grace <= MAX_DISCONNECT_GRACE:
        found.append(
            FieldViolation(
                "disconnect_grace", f"must be between 0 and {MAX_DISCONNECT_GRACE:g} seconds"
            )
        )
    return found


def _text_violations(params: GenerateParams, limits: Limits) -> list[FieldViolation]:
    found: list[FieldViolation] = []
    if len(params.prompt) > limits.max_message_chars:
        found.append(FieldViolation("prompt", f"longer than {limits.max_message_chars} characters"))
    if len(params.messages) > limits.max_messages:
        found.append(FieldViolation("messages", f"more than {limits.max_messages} messages"))
        return found  # one violation for the list, not one per message
    for i, (role, content, *_) in enumerate(params.messages):
        if role not in ROLES:
            found.append(
                FieldViolation(f"messages[{i}].role", f"must be one of {', '.join(sorted(ROLES))}")
            )
        if len(content) > limits.max_message_chars:
            found.append(
                FieldViolation(
                    f"messages[{i}].content", f"longer than {limits.max_message_chars} characters"
                )
            )
    total = len(params.prompt) + sum(
        len(m.content) + sum(len(c.arguments) for c in m.tool_calls) for m in params.messages
    )
    if total > limits.max_total_chars and not found:
        field = "messages" if params.messages else "prompt"
        found.append(FieldViolation(field, f"more than {limits.max_total_chars} characters in all"))
    return found


def _sampling_violations(sampling: Sampling, limits: Limits) -> list[FieldViolation]:
    found: list[FieldViolation] = []
    if sampling.max_tokens <= 0:
        found.append(FieldViolation("sampling.max_tokens", "must be greater than 0"))
    elif sampling.max_tokens > limits.max_tokens:
        found.append(FieldViolation("sampling.max_tokens", f"must be at most {limits.max_tokens}"))
    if sampling.temperature is not None and not 0 <= sampling.temperature < math.inf:
        found.append(FieldViolation("sampling.temperature", "must be a finite number >= 0"))
    if sampling.top_p is not None and not 0 < sampling.top_p <= 1:
        found.append(FieldViolation("sampling.top_p", "must be in (0, 1]"))
    if sampling.top_k is not None and sampling.top_k < 0:
        found.append(FieldViolation("sampling.top_k", "must be >= 0"))
    if len(sampling.stop) > MAX_STOP_STRINGS:
        found.append(FieldViolation("sampling.stop", f"at most {MAX_STOP_STRINGS} stop strings"))
    elif any(not s or len(s) > MAX_STOP_LENGTH for s in sampling.stop):
        found.append(
            FieldViolation(
                "sampling.stop", f"each stop string needs 1 to {MAX_STOP_LENGTH} characters"
            )
        )
    if len(sampling.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        found.append(
            FieldViolation("sampling.stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} token ids")
        )
    elif any(t < 0 for t in sampling.stop_token_ids):
        found.append(FieldViolation("sampling.stop_token_ids", "token ids are >= 0"))
    if not 1 <= sampling.n <= MAX_N:
        found.append(FieldViolation("sampling.n", f"must be between 1 and {MAX_N}"))
    if not 0 <= sampling.top_logprobs <= MAX_TOP_LOGPROBS:
        found.append(
            FieldViolation("sampling.top_logprobs", f"must be between 0 and {MAX_TOP_LOGPROBS}")
        )
    elif sampling.top_logprobs and not (sampling.logprobs or sampling.prompt_logprobs):
        found.append(FieldViolation("sampling.top_logprobs", "needs logprobs"))
    found += [FieldViolation(f"sampling.{f}", why) for f, why in sampling.structure.violations()]
    return [*found, *_penalty_violations(sampling)]


def _penalty_violations(sampling: Sampling) -> list[FieldViolation]:
    found = []
    bounds = {
        "frequency_penalty": (-MAX_PENALTY, MAX_PENALTY, "between -2 and 2"),
        "presence_penalty": (-MAX_PENALTY, MAX_PENALTY, "between -2 and 2"),
        "min_p": (0.0, 1.0, "between 0 and 1"),
    }
    for name, (low, high, what) in bounds.items():
        value = getattr(sampling, name)
        if value is not None and not low <= value <= high:
            found.append(FieldViolation(f"sampling.{name}", f"must be {what}"))
    penalty = sampling.repetition_penalty
    if penalty is not None and not 0 < penalty <= MAX_REPETITION_PENALTY:
        message = f"must be in (0, {MAX_REPETITION_PENALTY:g}]"
        found.append(FieldViolation("sampling.repetition_penalty", message))
    if len(sampling.logit_bias) > MAX_LOGIT_BIAS:
        message = f"at most {MAX_LOGIT_BIAS} token ids"
        found.append(FieldViolation("sampling.logit_bias", message))
    elif any(t < 0 or not -MAX_BIAS <= b <= MAX_BIAS for t, b in sampling.logit_bias):
        message = f"token ids are >= 0 and biases between -{MAX_BIAS:g} and {MAX_BIAS:g}"
        found.append(FieldViolation("sampling.logit_bias", message))
    return found
