"""How each kind of engine server is spoken to, free of I/O: the request body a run becomes,
and what each streamed chunk of the answer says.

Every kind takes the prompt as token ids. vLLM (`/v1/completions` with
`return_token_ids`), SGLang (`/generate`) and llama.cpp's server (`/completion` with
`return_tokens`) send back the generated token ids with each chunk; a plain
OpenAI-compatible server (`openai`) sends text only, and its tokens are counted by
tokenizing that text. The versions each shape was checked against are in
`tests/fixtures/engines/`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.sampling import Priority, SamplingParams

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


# What a kind of server cannot honour: the field of SamplingParams, and why.
UNSUPPORTED: dict[str, dict[str, str]] = {
    "openai": {
        "top_k": "OpenAI's completions API has no top_k",
        "ignore_eos": "OpenAI's completions API has no ignore_eos",
        "stop_token_ids": "OpenAI's completions API returns no token ids to stop on",
        "repetition_penalty": "OpenAI's completions API has no repetition_penalty",
        "min_p": "OpenAI's completions API has no min_p",
    },
}
# The values that leave a field off, beside absent, zero and empty.
NEUTRAL = {"repetition_penalty": 1.0}


def unsupported(kind: str, sampling: Mapping[str, Any]) -> tuple[str, str] | None:
    """The first field set in `sampling` (SamplingParams' fields by name; unset ones absent,
    empty, zero or neutral) that a `kind` server cannot honour, with why; None for another
    kind."""
    for name, why in UNSUPPORTED.get(kind, {}).items():
        value = sampling.get(name)
        if value and value != NEUTRAL.get(name):
            return name, why
    return None


def _penalties(params: SamplingParams, repetition: str = "repetition_penalty") -> dict[str, Any]:
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
    keeps what it saw."""

    def read(self, data: dict[str, Any]) -> Delta:
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class Dialect:
    """One kind of engine server: its generation path and the shape of its bodies."""

    kind: str
    path: str
    body: Callable[[Request], dict[str, Any]]
    reader: Callable[[], Reader]
    # Where the server says it is up; 200 once it can take requests.
    health_path: str = "/health"
    # Prometheus text with how many requests it queues unseen; "" when it has none.
    metrics_path: str = "/metrics"
    # The metric whose value counts requests the server holds back (waiting for a slot).
    waiting_metric: str = ""
    # Streams end with `data: [DONE]`.
    done_marker: bool = True


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
        raise MalformedChunk(f"{what} is not a list of token ids")
    return tuple(value)


def _text(value: Any, what: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise MalformedChunk(f"{what} is not a string")
    return value


def _optional_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# --- OpenAI's completions API, and vLLM's, which extends it ---------------------------


def _openai_sampling(params: SamplingParams) -> dict[str, Any]:
    body: dict[str, Any] = {
        "max_tokens": params.max_tokens,
        "temperature": 0.0 if params.is_greedy else params.temperature,
        "top_p": params.top_p,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if params.seed is not None:
        body["seed"] = params.seed
    if params.stop:
        body["stop"] = list(params.stop)
    return {**body, **_penalties(params)}


def openai_body(request: Request) -> dict[str, Any]:
    return {
        "model": request.adapter or request.model,
        "prompt": list(request.prompt),
        **_openai_sampling(request.params),
    }


def vllm_body(request: Request) -> dict[str, Any]:
    params = request.params
    body = openai_body(request)
    body["return_token_ids"] = True
    body["skip_special_tokens"] = True
    if params.top_k > 0 and not params.is_greedy:
        body["top_k"] = params.top_k
    if params.stop_token_ids:
        body["stop_token_ids"] = list(params.stop_token_ids)
    if params.ignore_eos:
        body["ignore_eos"] = True
    if request.cache_namespace:
        body["cache_salt"] = cache_salt(request.cache_namespace)
    if request.send_priority:
        body["priority"] = int(request.priority)  # vLLM serves lower values first
    return body


def cache_salt(namespace: str) -> str:
    """The run's cache namespace as a salt every server takes (vLLM's: 1 to 128
    characters, none of `@/\\`): requests with different salts share no cached prefix."""
    return hashlib.sha256(namespace.encode()).hexdigest()[:32]


# OpenAI's and vLLM's finish reasons; "stop" on a matched stop string becomes
# "stop_sequence", as the built-in engine says it.
OPENAI_FINISH = {
    "stop": "stop",
    "length": "length",
    "abort": "abort",
    "repetition": "stop",
    "content_filter": "stop",
}


def _openai_finish(reason: Any, stop_reason: Any) -> str | None:
    if reason is None:
        return None
    if reason not in OPENAI_FINISH:
        raise MalformedChunk(f"unknown finish_reason {reason!r}")
    if reason == "stop" and isinstance(stop_reason, str):
        return "stop_sequence"
    return OPENAI_FINISH[str(reason)]


def _usage(data: dict[str, Any]) -> tuple[int | None, int | None]:
    usage = data.get("usage")
    if not isinstance(usage, dict):
        return None, None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return _optional_int(usage.get("prompt_tokens")), _optional_int(cached)


class CompletionsReader(Reader):
    """`/v1/completions` chunks: text per choice, token ids when the server adds them
    (vLLM's `token_ids`), usage in the last chunk."""

    def __init__(self, token_ids: bool) -> None:
        self.token_ids = token_ids

    def read(self, data: dict[str, Any]) -> Delta:
        choices = data.get("choices")
        if not isinstance(choices, list):
            raise MalformedChunk("the chunk has no choices")
        prompt_tokens, cached = _usage(data)
        if not choices:  # the usage chunk
            return Delta(num_prompt_tokens=prompt_tokens, num_cached_prompt_tokens=cached)
        choice = choices[0]
        if not isinstance(choice, dict):
            raise MalformedChunk("a choice is not an object")
        token_ids: tuple[int, ...] = ()
        if self.token_ids:
            token_ids = _ints(choice.get("token_ids") or [], "choices[0].token_ids")
        return Delta(
            token_ids=token_ids,
            text=_text(choice.get("text"), "choices[0].text"),
            finish_reason=_openai_finish(choice.get("finish_reason"), choice.get("stop_reason")),
            num_prompt_tokens=prompt_tokens,
            num_cached_prompt_tokens=cached,
        )


# --- SGLang's native /generate ---------------------------------------------------------


def sglang_body(request: Request) -> dict[str, Any]:
    params = request.params
    sampling: dict[str, Any] = {
        "max_new_tokens": params.max_tokens,
        "temperature": 0.0 if params.is_greedy else params.temperature,
        "top_p": params.top_p,
        "skip_special_tokens": True,
        **_penalties(params),
    }
    if params.top_k > 0 and not params.is_greedy:
        sampling["top_k"] = params.top_k
    if params.seed is not None:
        sampling["sampling_seed"] = params.seed
    if params.stop:
        sampling["stop"] = list(params.stop)
    if params.stop_token_ids:
        sampling["stop_token_ids"] = list(params.stop_token_ids)
    if params.ignore_eos:
        sampling["ignore_eos"] = True
    body: dict[str, Any] = {
        "input_ids": list(request.prompt),
        "sampling_params": sampling,
        "stream": True,
    }
    if request.adapter:
        body["lora_path"] = request.adapter
    if request.cache_namespace:
        body["cache_salt"] = cache_salt(request.cache_namespace)
    if request.send_priority:
        body["priority"] = max(Priority) - request.priority  # SGLang serves higher first
    return body


SGLANG_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


class SGLangReader(Reader):
    """`/generate` chunks: `text` and `output_ids` cumulative over the request (the
    server's default streaming), `meta_info` with the counts and the finish reason."""

    def __init__(self) -> None:
        self.num_ids = 0
        self.num_chars = 0

    def read(self, data: dict[str, Any]) -> Delta:
        meta = data.get("meta_info")
        if not isinstance(meta, dict):
            raise MalformedChunk("the chunk has no meta_info")
        ids = _ints(data.get("output_ids") or [], "output_ids")
        text = _text(data.get("text"), "text")
        if len(ids) < self.num_ids or len(text) < self.num_chars:
            raise MalformedChunk("output_ids or text went backwards")
        new_ids, new_text = ids[self.num_ids :], text[self.num_chars :]
        self.num_ids, self.num_chars = len(ids), len(text)
        finish = meta.get("finish_reason")
        reason = None
        if finish is not None:
            kind = finish.get("type") if isinstance(finish, dict) else None
            if kind not in SGLANG_FINISH:
                raise MalformedChunk(f"unknown finish_reason {finish!r}")
            reason = SGLANG_FINISH[kind]
            if kind == "stop" and isinstance(finish.get("matched"), str):
                reason = "stop_sequence"
        return Delta(
            token_ids=new_ids,
            text=new_text,
            finish_reason=reason,
            num_prompt_tokens=_optional_int(meta.get("prompt_tokens")),
            num_cached_prompt_tokens=_optional_int(meta.get("cached_tokens")),
        )


# --- llama.cpp's server, native /completion --------------------------------------------


def llama_server_body(request: Request) -> dict[str, Any]:
    params = request.params
    body: dict[str, Any] = {
        "prompt": list(request.prompt),
        "n_predict": params.max_tokens,
        "temperature": 0.0 if params.is_greedy else params.temperature,
        "top_p": params.top_p,
        "top_k": 1 if params.is_greedy else max(params.top_k, 0),
        "min_p": params.min_p,
        "stream": True,
        "return_tokens": True,
        "cache_prompt": request.share_cache,
    }
    if params.seed is not None:
        body["seed"] = params.seed
    if params.stop:
        body["stop"] = list(params.stop)
    if params.ignore_eos:
        body["ignore_eos"] = True
    penalties = _penalties(params, repetition="repeat_penalty")
    penalties.pop("min_p", None)  # sent above: llama-server's default is not 0
    if "logit_bias" in penalties:  # llama-server takes [token id, bias] pairs
        penalties["logit_bias"] = [[token, bias] for token, bias in params.logit_bias]
    return {**body, **penalties}


LLAMA_STOP = {"eos": "stop", "word": "stop_sequence", "limit": "length"}


class LlamaServerReader(Reader):
    """`/completion` chunks: `content` and `tokens` per chunk, `stop: true` on the last
    with `stop_type` and the prompt's counts."""

    def read(self, data: dict[str, Any]) -> Delta:
        if not isinstance(data.get("stop"), bool):
            raise MalformedChunk("the chunk has no stop flag")
        token_ids = _ints(data.get("tokens") or [], "tokens")
        text = _text(data.get("content"), "content")
        if not data["stop"]:
            return Delta(token_ids=token_ids, text=text)
        stop_type = data.get("stop_type")
        if stop_type not in LLAMA_STOP:
            raise MalformedChunk(f"unknown stop_type {stop_type!r}")
        timings = data.get("timings")
        timings = timings if isinstance(timings, dict) else {}
        evaluated = _optional_int(data.get("tokens_evaluated"))
        cached = _optional_int(timings.get("cache_n"))
        return Delta(
            token_ids=token_ids,
            text=text,
            finish_reason=LLAMA_STOP[stop_type],
            num_prompt_tokens=evaluated,
            num_cached_prompt_tokens=cached,
        )


DIALECTS: dict[str, Dialect] = {
    "vllm": Dialect(
        "vllm",
        "/v1/completions",
        vllm_body,
        lambda: CompletionsReader(token_ids=True),
        waiting_metric="vllm:num_requests_waiting",
    ),
    "sglang": Dialect(
        "sglang",
        "/generate",
        sglang_body,
        SGLangReader,
        waiting_metric="sglang:num_queue_reqs",
    ),
    "llama-server": Dialect(
        "llama-server",
        "/completion",
        llama_server_body,
        LlamaServerReader,
        waiting_metric="llamacpp:requests_deferred",
        done_marker=False,
    ),
    "openai": Dialect(
        "openai",
        "/v1/completions",
        openai_body,
        lambda: CompletionsReader(token_ids=False),
        health_path="/v1/models",
        metrics_path="",
    ),
}


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
        data = json.loads(payload)
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
