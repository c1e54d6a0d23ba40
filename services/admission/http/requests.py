"""OpenAI-style request bodies, and their translation into admission's `GenerateParams`
(no I/O).

Unknown fields are ignored, as OpenAI's API does; a field that would change the answer in
a way Tollgate cannot honour (`suffix`, `best_of`, ...) is refused with a
400 naming it rather than silently dropped.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from engine.structure import FREE_TEXT, Structure, ToolCall
from services.admission.http.tools import structure_names, structure_of
from services.admission.requests import ChatTurn, GenerateParams, Limits, Sampling
from services.core.errors import FieldViolation, InvalidArgument

# OpenAI's default is the rest of the context; Tollgate reserves KV blocks for the whole
# answer up front, so an unset max_tokens must be a modest number.
DEFAULT_MAX_TOKENS = 512
# OpenAI's bound on the completions endpoint's logprobs.
MAX_COMPLETION_LOGPROBS = 5
MAX_SEED = 2**64 - 1
IDEMPOTENCY_HEADER = "idempotency-key"
GRACE_HEADER = "x-tollgate-disconnect-grace"
# OpenAI's role for system instructions to reasoning models; the chat templates know "system".
ROLE_ALIASES = {"developer": "system"}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = Field(
        default=None, description='text, or a list of `{"type": "text", "text": ...}` parts'
    )
    # An assistant's earlier calls; a tool's answer names the call it answers.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class _Common(BaseModel):
    """Fields both completion endpoints take."""

    # JSON has no infinities; Python's parser reads 1e999 as one.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # Beyond OpenAI's fields, as vLLM's server takes them.
    top_k: int | None = None
    ignore_eos: bool = False
    repetition_penalty: float | None = None
    min_p: float | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Common):
    prompt: str | list[str]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


def chat_params(
    body: ChatCompletionRequest, headers: Mapping[str, str], limits: Limits
) -> GenerateParams:
    """Raises InvalidArgument naming OpenAI's parameter."""
    violations = [*_common_violations(body), *_chat_violations(body)]
    messages = []
    for i, message in enumerate(body.messages):
        text = _message_text(message.content)
        if text is None:
            violations.append(
                FieldViolation(f"messages[{i}].content", "only text content parts are supported")
            )
        calls = _tool_calls(message.tool_calls or [], f"messages[{i}].tool_calls", violations)
        role = ROLE_ALIASES.get(message.role, message.role)
        messages.append(ChatTurn(role, text or "", calls, message.tool_call_id or ""))
    structure = _structure(body, violations)
    if violations:
        raise InvalidArgument(violations)
    max_tokens = (
        body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
    )
    return _params(
        body,
        headers,
        limits,
        max_tokens,
        messages=tuple(messages),
        structure=structure,
        logprobs=(bool(body.logprobs), body.top_logprobs or 0),
    )


def completion_params(
    body: CompletionRequest, headers: Mapping[str, str], limits: Limits
) -> GenerateParams:
    """Raises InvalidArgument naming OpenAI's parameter."""
    violations = [*_common_violations(body), *_completion_violations(body)]
    if violations:
        raise InvalidArgument(violations)
    prompt = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
    logprobs = (body.logprobs is not None, body.logprobs or 0)
    return _params(
        body,
        headers,
        limits,
        body.max_tokens,
        prompt=prompt,
        logprobs=logprobs,
        prompt_logprobs=bool(body.echo) and logprobs[0],
    )


def param_names(body: _Common) -> dict[str, str]:
    """OpenAI's name for each field path admission's validation may report."""
    names = {
        "sampling.max_tokens": "max_tokens",
        "sampling.temperature": "temperature",
        "sampling.top_p": "top_p",
        "sampling.seed": "seed",
        "sampling.top_k": "top_k",
        "sampling.stop": "stop",
        "sampling.frequency_penalty": "frequency_penalty",
        "sampling.presence_penalty": "presence_penalty",
        "sampling.repetition_penalty": "repetition_penalty",
        "sampling.min_p": "min_p",
        "sampling.logit_bias": "logit_bias",
        "sampling.logprobs": "logprobs",
        "sampling.prompt_logprobs": "echo",
        "sampling.n": "n",
        "sampling.top_logprobs": "logprobs",
        "idempotency_key": "Idempotency-Key",
        "disconnect_grace": GRACE_HEADER,
    }
    if isinstance(body, ChatCompletionRequest):
        names |= {"prompt": "messages", "sampling.top_logprobs": "top_logprobs"}
        names |= structure_names(
            "response_format.type",
            "response_format.json_schema",
            "function.",
            len(body.tools or ()),
        )
        if body.max_completion_tokens is not None:
            names["sampling.max_tokens"] = "max_completion_tokens"
    return names


def param_path(loc: Sequence[Any]) -> str:
    """`messages[0].content` for pydantic's location ("messages", 0, "content")."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    return path


def _params(
    body: _Common,
    headers: Mapping[str, str],
    limits: Limits,
    max_tokens: int | None,
    *,
    prompt: str = "",
    messages: tuple[ChatTurn, ...] = (),
    structure: Structure = FREE_TEXT,
    logprobs: tuple[bool, int] = (False, 0),
    prompt_logprobs: bool = False,
) -> GenerateParams:
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    return generate_params(
        body.model,
        headers,
        limits,
        Sampling(
            max_tokens=min(DEFAULT_MAX_TOKENS, limits.max_tokens)
            if max_tokens is None
            else max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            stop=stop,
            top_k=body.top_k,
            ignore_eos=body.ignore_eos,
            frequency_penalty=body.frequency_penalty,
            presence_penalty=body.presence_penalty,
            repetition_penalty=body.repetition_penalty,
            min_p=body.min_p,
            logit_bias=_logit_bias(body),
            structure=structure,
            logprobs=logprobs[0],
            top_logprobs=logprobs[1],
            n=1 if body.n is None else body.n,
            prompt_logprobs=prompt_logprobs,
        ),
        prompt=prompt,
        messages=messages,
    )


def generate_params(
    model: str,
    headers: Mapping[str, str],
    limits: Limits,
    sampling: Sampling,
    *,
    prompt: str = "",
    messages: tuple[ChatTurn, ...] = (),
) -> GenerateParams:
    """An HTTP request's run: interactive, followed to its end, with the idempotency key
    and disconnect grace its headers give."""
    return GenerateParams(
        model=model,
        prompt=prompt,
        messages=messages,
        sampling=sampling,
        priority="interactive",
        idempotency_key=headers.get(IDEMPOTENCY_HEADER, ""),
        disconnect_grace=_grace(headers, limits),
        until_terminal=True,
    )


def _grace(headers: Mapping[str, str], limits: Limits) -> float:
    raw = headers.get(GRACE_HEADER)
    if raw is None:
        return limits.default_disconnect_grace
    try:
        grace = float(raw)
    except ValueError:
        grace = math.nan
    if not math.isfinite(grace):
        raise InvalidArgument([FieldViolation(GRACE_HEADER, "must be a number of seconds")])
    return grace


def _message_text(content: str | list[dict[str, Any]] | None) -> str | None:
    """The text of a message, or None when it has parts other than text."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        text = part.get("text")
        if part.get("type") != "text" or not isinstance(text, str):
            return None
        texts.append(text)
    return "".join(texts)


def _unsupported(name: str, why: str = "is not supported") -> FieldViolation:
    return FieldViolation(name, why)


def _common_violations(body: _Common) -> list[FieldViolation]:
    found = []
    if body.seed is not None and not 0 <= body.seed <= MAX_SEED:
        found.append(FieldViolation("seed", f"must be between 0 and {MAX_SEED}"))
    if any(not _is_token_id(token) for token in body.logit_bias or {}):
        found.append(FieldViolation("logit_bias", "keys are token ids (strings of digits)"))
    return found


def _is_token_id(key: str) -> bool:
    return key.isascii() and key.isdigit() and len(key) <= 10


def _logit_bias(body: _Common) -> tuple[tuple[int, float], ...]:
    return tuple(sorted((int(token), bias) for token, bias in (body.logit_bias or {}).items()))


def _structure(body: ChatCompletionRequest, found: list[FieldViolation]) -> Structure:
    return structure_of(
        body.response_format, body.tools, body.tool_choice, body.parallel_tool_calls, found
    )


def _tool_calls(
    calls: list[dict[str, Any]], field: str, found: list[FieldViolation]
) -> tuple[ToolCall, ...]:
    """An assistant message's earlier calls, in OpenAI's shape."""
    read = []
    for i, call in enumerate(calls):
        function = call.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            found.append(FieldViolation(f"{field}[{i}].function", "give the name and arguments"))
            continue
        arguments = function.get("arguments", "{}")
        read.append(
            ToolCall(
                str(call.get("id", "")),
                function["name"],
                arguments if isinstance(arguments, str) else json.dumps(arguments),
            )
        )
    return tuple(read)


def _chat_violations(body: ChatCompletionRequest) -> list[FieldViolation]:
    found = []
    if body.top_logprobs and not body.logprobs:
        found.append(FieldViolation("top_logprobs", "needs logprobs: true"))
    if not body.messages:
        found.append(FieldViolation("messages", "must not be empty"))
    return found


def _completion_violations(body: CompletionRequest) -> list[FieldViolation]:
    found = []
    if isinstance(body.prompt, list) and len(body.prompt) != 1:
        found.append(FieldViolation("prompt", "give one prompt (a string)"))
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_COMPLETION_LOGPROBS:
        found.append(FieldViolation("logprobs", f"must be between 0 and {MAX_COMPLETION_LOGPROBS}"))
    if body.suffix:
        found.append(_unsupported("suffix"))
    if body.best_of not in (None, 1):
        found.append(_unsupported("best_of", "only best_of=1 is supported"))
    return found
