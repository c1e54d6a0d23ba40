"""Anthropic's Messages API (no I/O): request bodies and their translation into
admission's `GenerateParams`, the `message` object and stream events a run's events make,
and Anthropic's error body.

Unknown fields are ignored; content Tollgate cannot honour (images, documents, thinking)
is refused with a 400 naming it. `output_config.format` (structured outputs) constrains
the answer to its JSON schema. Tools are Anthropic's `{name, description, input_schema}`
and `tool_choice` `{"type": "auto" | "any" | "tool" | "none", "name",
"disable_parallel_tool_use"}`; earlier calls come back as `tool_use` blocks and their
answers as `tool_result` blocks.

A stream's events are made from the run's events by the same fold (`Completion`) as
OpenAI's chunks: several Anthropic events may come of one run event, and only the last of
them carries `id: <seq>`, so a client's `Last-Event-ID` names the last run event it has
whole, and a stream resumed after it (`Message.frames` of every event, those up to it
unsent) goes on with exactly what follows.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict

import tollgate.types
from engine.structure import Structure, ToolCall
from services.admission.http.requests import GRACE_HEADER, function_tool, generate_params
from services.admission.http.responses import (
    Completion,
    HttpError,
    http_error,
    run_failure,
    sse_frame,
)
from services.admission.requests import ChatTurn, GenerateParams, Limits, Sampling
from services.core.errors import ApiError, FieldViolation, InvalidArgument
from services.core.runs import RunState, StoredEvent

MESSAGES_PATH = "/v1/messages"
# Anthropic's status for an overloaded API: Tollgate's UNAVAILABLE backpressure.
OVERLOADED = 529
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    OVERLOADED: "overloaded_error",
}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "stop_sequence": "stop_sequence"}
TOOL_CHOICES = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}


class MessageParam(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]]


class CountTokensRequest(BaseModel):
    """What `POST /v1/messages/count_tokens` counts: a message request but its sampling."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    model: str
    messages: list[MessageParam]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None


def message_params(
    body: MessagesRequest, headers: Mapping[str, str], limits: Limits
) -> GenerateParams:
    """Raises InvalidArgument naming Anthropic's field."""
    turns, structure = _conversation(body)
    sampling = Sampling(
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        stop=tuple(body.stop_sequences or ()),
        structure=structure,
    )
    return generate_params(body.model, headers, limits, sampling, messages=turns)


def count_params(body: CountTokensRequest, limits: Limits) -> GenerateParams:
    """The run `body` would start, to count its prompt; raises InvalidArgument."""
    turns, structure = _conversation(body)
    sampling = Sampling(max_tokens=1, structure=structure)
    return generate_params(body.model, {}, limits, sampling, messages=turns)


def param_names(body: CountTokensRequest) -> dict[str, str]:
    """Anthropic's name for each field path admission's validation may report."""
    names = {f"sampling.{name}": name for name in ("max_tokens", "temperature", "top_p", "top_k")}
    names |= {
        "prompt": "messages",
        "sampling.stop": "stop_sequences",
        "sampling.tools": "tools",
        "sampling.tool_choice.mode": "tool_choice.type",
        "sampling.tool_choice.function": "tool_choice.name",
        "sampling.response_format.json_schema": "output_config.format.schema",
        "idempotency_key": "Idempotency-Key",
        "disconnect_grace": GRACE_HEADER,
    }
    for i in range(len(body.tools or ())):
        names[f"sampling.tools[{i}].name"] = f"tools[{i}].name"
        names[f"sampling.tools[{i}].parameters"] = f"tools[{i}].input_schema"
    return names


def _conversation(body: CountTokensRequest) -> tuple[tuple[ChatTurn, ...], Structure]:
    found: list[FieldViolation] = []
    if body.thinking is not None and body.thinking.get("type") != "disabled":
        found.append(FieldViolation("thinking", "is not supported"))
    turns: list[ChatTurn] = []
    if body.system:
        turns.append(ChatTurn("system", _text(body.system, "system", found)))
    for i, message in enumerate(body.messages):
        turns += _turns(message, f"messages[{i}]", found)
    if not body.messages:
        found.append(FieldViolation("messages", "must not be empty"))
    structure = _structure(body, found)
    if found:
        raise InvalidArgument(found)
    return tuple(turns), structure


def _text(content: str | list[dict[str, Any]], field: str, found: list[FieldViolation]) -> str:
    """The text of a string or of text blocks."""
    if isinstance(content, str):
        return content
    texts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text":
            found.append(FieldViolation(f"{field}[{j}].type", "only text blocks are supported"))
            continue
        if not isinstance(block.get("text"), str):
            found.append(FieldViolation(f"{field}[{j}].type", "only text blocks are supported"))
            continue
        texts.append(block["text"])
    return "".join(texts)


def _turns(message: MessageParam, field: str, found: list[FieldViolation]) -> list[ChatTurn]:
    """A message's turns: each `tool_result` a tool turn, then its text (with an
    assistant's `tool_use` blocks as its calls)."""
    if message.role not in ("user", "assistant"):
        found.append(FieldViolation(f"{field}.role", "must be user or assistant"))
    blocks = (
        [{"type": "text", "text": message.content}]
        if isinstance(message.content, str)
        else message.content
    )
    turns, texts, calls = [], [], []
    for j, block in enumerate(blocks):
        kind, where = block.get("type"), f"{field}.content[{j}]"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and message.role == "assistant":
            calls.append(_tool_use(block, where, found))
        elif kind == "tool_result" and message.role == "user":
            content = block.get("content") or ""
            if not isinstance(content, str | list):
                found.append(FieldViolation(f"{where}.content", "give text or text blocks"))
                content = ""
            text = _text(content, f"{where}.content", found)
            turns.append(ChatTurn("tool", text, (), str(block.get("tool_use_id", ""))))
        else:
            found.append(FieldViolation(f"{where}.type", f"{str(kind)[:32]!r} is not supported"))
    if texts or calls or not turns:
        turns.append(ChatTurn(message.role, "".join(texts), tuple(calls)))
    return turns


def _tool_use(block: Mapping[str, Any], where: str, found: list[FieldViolation]) -> ToolCall:
    name, arguments = block.get("name"), block.get("input", {})
    if not isinstance(name, str) or not isinstance(arguments, dict):
        found.append(FieldViolation(where, "a tool_use block has a name and an input object"))
        return ToolCall("", "", "{}")
    return ToolCall(str(block.get("id", "")), name, json.dumps(arguments))


def _structure(body: CountTokensRequest, found: list[FieldViolation]) -> Structure:
    tools = []
    for i, tool in enumerate(body.tools or ()):
        if tool.get("type") not in (None, "custom"):
            found.append(FieldViolation(f"tools[{i}].type", "only custom tools are supported"))
            continue
        tools.append(function_tool(tool, "input_schema"))
    response_format, json_schema = _output_format(body, found)
    choice = body.tool_choice or {}
    kind = str(choice.get("type", "auto" if tools else "none"))
    if kind not in TOOL_CHOICES:
        found.append(
            FieldViolation("tool_choice.type", f"must be one of {', '.join(TOOL_CHOICES)}")
        )
    return Structure(
        response_format=response_format,
        json_schema=json_schema,
        tools=tuple(tools),
        tool_choice=TOOL_CHOICES.get(kind, "auto"),
        function=str(choice.get("name", "")) if kind == "tool" else "",
        parallel_tool_calls=not choice.get("disable_parallel_tool_use", False),
        tool_format="",  # the model's own, chosen by the gateway
    )


def _output_format(body: CountTokensRequest, found: list[FieldViolation]) -> tuple[str, str]:
    """`output_config.format` (structured outputs) as (response_format, json_schema)."""
    spec = (body.output_config or {}).get("format")
    if spec is None:
        return "text", ""
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(spec, dict) or spec.get("type") != "json_schema" or schema is None:
        found.append(FieldViolation("output_config.format", "give a json_schema and its schema"))
        return "text", ""
    return "json_schema", json.dumps(schema)


def anthropic_error(answer: HttpError) -> HttpError:
    """`answer` (OpenAI's error body) told in Anthropic's body and status codes."""
    status = OVERLOADED if answer.status == 503 else answer.status
    default = "api_error" if status >= 500 else "invalid_request_error"
    error = answer.body.get("error") or {}
    message = str(error.get("message") or "")
    return HttpError(status, error_json(ERROR_TYPES.get(status, default), message), answer.headers)


def error_json(error_type: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type, "message": message}}


def error_frame(error: ApiError) -> bytes:
    """The `error` event that ends a stream refused while it streams."""
    return sse_frame(anthropic_error(http_error(error)).body, event="error")


def shaped_for(path: str, answer: HttpError) -> HttpError:
    """The error answer as the API that `path` belongs to gives it."""
    if path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/"):
        return anthropic_error(answer)
    return answer


class Message:
    """One answer of the Messages API as its run's events tell it: the `message` object,
    or the stream's events. A run's text is held back while it may still be tool calls
    (`Completion.holds_back`); calls go as `tool_use` blocks once it ends."""

    def __init__(
        self, run_id: str, model: str, tools: bool, stop_sequences: tuple[str, ...] = ()
    ) -> None:
        self.completion = Completion(True, run_id, model, tools=tools)
        self.stop_sequences = stop_sequences
        self.input_tokens = 0
        self.reason = "stop"
        self.blocks = 0  # content blocks the stream has opened
        self.text_open = False

    def add(self, event: StoredEvent) -> None:
        """Takes in what `event` says of the answer."""
        self.completion.add(event)
        if event.kind == RunState.QUEUED:
            self.input_tokens = len(event.payload.get("prompt_token_ids") or ())
        elif event.kind == RunState.COMPLETED:
            self.reason = event.payload.get("finish_reason") or "stop"

    def body(self) -> dict[str, Any]:
        """The whole `message`, once its run completed."""
        answer = self.completion.answers[0]
        content = [_tool_use_json(call) for call in answer.tool_calls]
        if not content and answer.text:
            content = [{"type": "text", "text": answer.text}]
        return {**self._head(), "content": content, **self._stop(), "usage": self._usage()}

    def frames(self, event: StoredEvent) -> list[bytes]:
        """The stream's events that `event` adds; only the last carries its seq."""
        self.add(event)
        events = self._events(event)
        return [
            sse_frame(data, event.seq if i == len(events) - 1 else None, str(data["type"]))
            for i, data in enumerate(events)
        ]

    def _events(self, event: StoredEvent) -> list[dict[str, Any]]:
        if event.kind == RunState.QUEUED:
            message = {**self._head(), "content": [], "stop_reason": None, "stop_sequence": None}
            return [{"type": "message_start", "message": message | {"usage": self._usage()}}]
        if event.kind == RunState.STREAMING:
            answer = self.completion.hold(event)
            if self.completion.holds_back(answer) or not answer.held:
                return []
            text, answer.held = answer.held, ""
            return self._text_events(text)
        if event.kind == RunState.COMPLETED:
            return self._ending()
        failure = run_failure(event)
        if failure is None:
            return []
        status = 409 if event.kind == RunState.CANCELLED else 500
        return [anthropic_error(HttpError(status, failure, {})).body]

    def _text_events(self, text: str) -> list[dict[str, Any]]:
        events = []
        if not self.text_open:
            events = self._open({"type": "text", "text": ""})
            self.text_open = True
        delta = {"type": "text_delta", "text": text}
        return [*events, {"type": "content_block_delta", "index": self.blocks - 1, "delta": delta}]

    def _open(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        """A content block's start; the stream's first is followed by a ping, as
        Anthropic's are."""
        self.blocks += 1
        start = {"type": "content_block_start", "index": self.blocks - 1, "content_block": block}
        return [start, {"type": "ping"}] if self.blocks == 1 else [start]

    def _ending(self) -> list[dict[str, Any]]:
        answer = self.completion.answers[0]
        events = []
        if answer.tool_calls:
            for call in answer.tool_calls:
                events += self._open(_tool_use_json(call) | {"input": {}})
                delta = {"type": "input_json_delta", "partial_json": call.arguments}
                events.append(
                    {"type": "content_block_delta", "index": self.blocks - 1, "delta": delta}
                )
                events.append({"type": "content_block_stop", "index": self.blocks - 1})
        else:
            if answer.held:
                events += self._text_events(answer.held)
                answer.held = ""
            if self.text_open:
                events.append({"type": "content_block_stop", "index": self.blocks - 1})
        usage = {"output_tokens": self._usage()["output_tokens"]}
        events.append({"type": "message_delta", "delta": self._stop(), "usage": usage})
        return [*events, {"type": "message_stop"}]

    def _head(self) -> dict[str, Any]:
        return {
            "id": self.completion.run_id,
            "type": "message",
            "role": "assistant",
            "model": self.completion.model,
        }

    def _stop(self) -> dict[str, Any]:
        """The stop reason, and the stop sequence when it is known which one matched."""
        if self.completion.answers[0].tool_calls:
            return {"stop_reason": "tool_use", "stop_sequence": None}
        reason = STOP_REASONS.get(self.reason, "end_turn")
        matched = None
        if reason == "stop_sequence" and len(self.stop_sequences) == 1:
            matched = self.stop_sequences[0]
        return {"stop_reason": reason, "stop_sequence": matched}

    def _usage(self) -> dict[str, int]:
        usage = self.completion.usage or {}
        return {
            "input_tokens": int(usage.get("prompt_tokens", self.input_tokens)),
            "output_tokens": int(usage.get("output_tokens", 0)),
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        }


def _tool_use_json(call: tollgate.types.ToolCall) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": call.id,
        "name": call.name,
        "input": json.loads(call.arguments),
    }
