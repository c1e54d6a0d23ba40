"""Anthropic's Messages API bodies, and their translation into admission's
`GenerateParams` (no I/O); `anthropic_answers.py` makes its answers.

Unknown fields are ignored; content Tollgate cannot honour (images, documents, thinking)
is refused with a 400 naming it. `output_config.format` (structured outputs) constrains
the answer to its JSON schema. Tools are Anthropic's `{name, description, input_schema}`
and `tool_choice` `{"type": "auto" | "any" | "tool" | "none", "name",
"disable_parallel_tool_use"}`; earlier calls come back as `tool_use` blocks and their
answers as `tool_result` blocks.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict

from engine.structure import Structure, ToolCall
from services.admission.http.requests import GRACE_HEADER, IDEMPOTENCY_HEADER, generate_params
from services.admission.http.tools import function_tool
from services.admission.requests import ChatTurn, GenerateParams, Limits, Sampling
from services.core.errors import FieldViolation, InvalidArgument

RESUME_HEADER = "last-event-id"
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
    if RESUME_HEADER in headers and IDEMPOTENCY_HEADER not in headers:
        why = "resumes the stream of the request with the same Idempotency-Key: send it too"
        raise InvalidArgument([FieldViolation("Last-Event-ID", why)])
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
