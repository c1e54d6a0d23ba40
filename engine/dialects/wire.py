"""What every kind of engine server shares: the run as sent (`Request`), what a chunk adds
(`Delta`), the `Reader` and `Dialect` each kind fills in, the helpers that read a chunk's
values and write a body's penalties, schema and cache salt, and the SSE and Prometheus text
every kind streams and exposes."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.errors import RequestError
from engine.outputs import TokenLogprob
from engine.sampling import Priority, SamplingParams
from engine.structure import json_value

KINDS = ("vllm", "sglang", "llama-server", "openai")


class MalformedChunk(ValueError):
    """An engine server sent a chunk that is not what its kind sends."""


@dataclass(frozen=True, slots=True)
class Delta:
    """What one chunk adds to a request's output; `finish_reason` is one of
    engine.outputs.FINISH_REASONS once the server says the request ended."""

    token_ids: tuple[int, ...] = ()
    text: str = ""
    finish_reason: str | None = None
    num_prompt_tokens: int | None = None
    num_cached_prompt_tokens: int | None = None
    # One per token in `token_ids` when the run asked for logprobs.
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class Request:
    """One run as the engine server should see it."""

    prompt: Sequence[int]
    params: SamplingParams
    model: str
    # The LoRA adapter's name on the server; "" for the base model. vLLM and OpenAI
    # servers take it as `model`, SGLang as `lora_path`.
    adapter: str = ""
    cache_namespace: str = ""
    priority: Priority = Priority.INTERACTIVE
    # Whether the server may reuse cached prompt prefixes across requests (llama-server).
    share_cache: bool = False
    # Sent to servers that schedule by priority (vLLM, SGLang) when they were started so.
    send_priority: bool = False


def penalties(params: SamplingParams, repetition: str = "repetition_penalty") -> dict[str, Any]:
    """The penalties and biases set, under OpenAI's names (`repetition` for the
    repetition penalty's); logit_bias as OpenAI's map of token ids as strings."""
    body: dict[str, Any] = {}
    if params.frequency_penalty:
        body["frequency_penalty"] = params.frequency_penalty
    if params.presence_penalty:
        body["presence_penalty"] = params.presence_penalty
    if params.repetition_penalty != 1.0:
        body[repetition] = params.repetition_penalty
    if params.min_p:
        body["min_p"] = params.min_p
    if params.logit_bias:
        body["logit_bias"] = {str(token): bias for token, bias in params.logit_bias}
    return body


class Reader:
    """Turns one request's chunks into deltas; a kind that streams cumulative text or ids
    keeps what it saw. `logprobs` is the run's: how many alternatives each token's
    logprob comes with, None when it asked for none."""

    def __init__(self, logprobs: int | None = None) -> None:
        self.logprobs = logprobs

    def read(self, data: dict[str, Any]) -> Delta:
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class Dialect:
    """One kind of engine server: its generation path and the shape of its bodies."""

    kind: str
    path: str
    body: Callable[[Request], dict[str, Any]]
    # Made with the run's `logprobs`.
    reader: Callable[[int | None], Reader]
    # Where the server says it is up; 200 once it can take requests.
    health_path: str = "/health"
    # Prometheus text with how many requests it queues unseen; "" when it has none.
    metrics_path: str = "/metrics"
    # The metric whose value counts requests the server holds back (waiting for a slot).
    waiting_metric: str = ""
    # Streams end with `data: [DONE]`.
    done_marker: bool = True


def ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
        raise MalformedChunk(f"{what} is not a list of token ids")
    return tuple(value)


def text(value: Any, what: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise MalformedChunk(f"{what} is not a string")
    return value


def optional_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def logprob(value: Any, what: str) -> float:
    """A logprob as sent; null is -inf, which JSON cannot write (llama-server's and
    SGLang's encoders write it as null)."""
    if value is None:
        return -math.inf
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise MalformedChunk(f"{what} is not a logprob")
    return float(value)


def top(alternatives: Iterable[tuple[int, float]], k: int) -> tuple[tuple[int, float], ...]:
    """The k likeliest of a token's alternatives, likeliest first, leaving out those at
    -inf (tokens the server could not pick)."""
    ranked = sorted((a for a in alternatives if a[1] > -math.inf), key=lambda a: -a[1])
    return tuple(ranked[:k])


def schema(json_schema: str) -> Any:
    try:
        return json_value(json_schema)
    except ValueError:
        raise RequestError("json_schema is not JSON") from None


def cache_salt(namespace: str) -> str:
    """The run's cache namespace as a salt every server takes (vLLM's: 1 to 128
    characters, none of `@/\\`): requests with different salts share no cached prefix."""
    return hashlib.sha256(namespace.encode()).hexdigest()[:32]


# What `sse_data` returns for `data: [DONE]`.
DONE: dict[str, Any] = {}


def sse_data(line: bytes) -> dict[str, Any] | None:
    """The JSON object of one SSE `data:` line, DONE for `[DONE]`, None for other lines
    (comments such as llama-server's keep-alive `:`, blank lines)."""
    if not line.startswith(b"data:"):
        return None
    payload = line[5:].strip()
    if payload == b"[DONE]":
        return DONE
    if not payload:
        return None
    try:
        data = json_value(payload)
    except ValueError:
        raise MalformedChunk("a data line is not JSON") from None
    if not isinstance(data, dict):
        raise MalformedChunk("a data line is not a JSON object")
    if "error" in data and "choices" not in data and "stop" not in data:
        raise MalformedChunk(f"the server sent an error: {str(data['error'])[:200]}")
    return data


def waiting(metrics_text: str, metric: str) -> float | None:
    """The sum of `metric`'s samples in Prometheus text, None when it is absent."""
    total, found = 0.0, False
    for line in metrics_text.splitlines():
        if line.startswith(metric) and line[len(metric) : len(metric) + 1] in ("{", " "):
            try:
                total += float(line.rsplit(None, 1)[-1])
            except ValueError:
                continue
            found = True
    return total if found else None
